"""Sampler and SamplingMetadata: greedy, seeded draws, filters against naive references, penalties, logprobs."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, apply_penalties
from pagedllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
# NOTE: plain torch.allclose, not torch.testing.assert_close: the latter imports torch.distributed (~2 s).
# Chi-square critical values at significance 0.001, indexed by degrees of freedom (1..9).
CHI2_CRIT_0_001 = [math.inf, 10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """These tensors are tiny: a second intra-op thread only adds wake-up latency (tens of ms per op when
    the shared cores are busy), so run single-threaded and restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(
    params: list[SamplingParams],
    vocab: int,
    generators: list[torch.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        generators if generators is not None else [None] * n,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        vocab,
        CPU,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(device=CPU).manual_seed(seed)


def random_logits(batch: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=seeded(seed)) * scale


def allowed_set(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Naive per-row reference in plain Python floats: the tokens the random path may return."""
    scaled = [x / p.temperature for x in logits.double().tolist()]

    def softmax(xs: list[float]) -> list[float]:
        top = max(xs)
        exps = [math.exp(x - top) for x in xs]
        return [e / sum(exps) for e in exps]

    probs = softmax(scaled)
    keep = list(range(len(scaled)))
    if p.min_p > 0:
        keep = [t for t in keep if probs[t] >= p.min_p * max(probs)]
    ranked = sorted(keep, key=lambda t: -scaled[t])
    if p.top_k > 0:
        ranked = ranked[: p.top_k]
    if p.top_p < 1.0:
        total = 0.0
        for i, m in enumerate(softmax([scaled[t] for t in ranked])):
            total += m
            if total >= p.top_p:
                ranked = ranked[: i + 1]
                break
    return set(ranked)


def test_greedy_is_argmax() -> None:
    logits = random_logits(8, 100)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0) for _ in range(8)], 100))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_half_precision_logits_greedy_fast_path_and_float_paths() -> None:
    """Models return logits in their own dtype (ModelProtocol.compute_logits). A plain greedy batch takes the
    argmax of those as given -- the same ids as the float32 copy's, ties included (first index) -- while
    logprobs are computed from float32 values."""
    logits = (random_logits(6, 300, seed=7) * 4).to(torch.bfloat16)  # bf16's coarse steps: many near ties
    logits[2, 10] = logits[2, 200] = logits[2].max() + 1  # an exact tie: both paths return the first index
    greedy = build([SamplingParams(temperature=0.0) for _ in range(6)], 300)
    out = Sampler()(logits, greedy)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1)) and int(out.sampled_token_ids[2]) == 10
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None

    with_logprobs = build([SamplingParams(temperature=0.0, logprobs=2) for _ in range(6)], 300)
    lp = Sampler()(logits, with_logprobs).logprobs
    assert lp is not None and lp.logprobs.dtype == torch.float32
    assert torch.allclose(lp.logprobs[:, 1:], torch.log_softmax(logits.float(), -1).topk(2, -1).values)


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    logits = random_logits(6, 50, scale=0.1)  # flat: random rows will rarely hit the argmax
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    out = Sampler()(logits, build(params, 50)).sampled_token_ids
    assert torch.equal(out[1::2], logits.argmax(-1)[1::2])


def test_top_k_1_is_greedy_at_temperature_1() -> None:
    logits = random_logits(16, 200, scale=0.5)
    params = [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(16)]
    gens: list[torch.Generator | None] = [seeded(i) if i % 2 else None for i in range(16)]
    for _ in range(5):
        out = Sampler()(logits, build(params, 200, gens)).sampled_token_ids
        assert torch.equal(out, logits.argmax(-1))


def test_logits_are_not_modified() -> None:
    logits = random_logits(4, 30)
    before = logits.clone()
    params = [SamplingParams(top_k=3, top_p=0.8, min_p=0.1, repetition_penalty=1.5, min_tokens=2)] * 4
    for p in params:
        p._all_stop_token_ids = {0}
    Sampler()(logits, build(params, 30, outputs=[[1, 2]] * 4, prompts=[[3]] * 4))
    assert torch.equal(logits, before)


def _draw_steps(
    rows: list[tuple[SamplingParams, torch.Generator | None]], steps: int, target: int
) -> list[int]:
    """Sample `steps` times from fresh per-step logits; return row `target`'s tokens."""
    params = [p for p, _ in rows]
    gens = [g for _, g in rows]
    tokens = []
    for step in range(steps):
        logits = random_logits(len(rows), 500, seed=100 + step, scale=0.3)
        # The target row must see the same logits in every batch layout: pin it to a per-step row.
        logits[target] = random_logits(1, 500, seed=999 + step, scale=0.3)[0]
        tokens.append(int(Sampler()(logits, build(params, 500, gens)).sampled_token_ids[target]))
    return tokens


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = _draw_steps([(target, seeded(1234))], steps=6, target=0)
    again = _draw_steps([(target, seeded(1234))], steps=6, target=0)
    crowded = _draw_steps(
        [
            (SamplingParams(temperature=0.0), None),
            (SamplingParams(seed=7), seeded(7)),
            (SamplingParams(top_k=5), None),
            (target, seeded(1234)),
            (SamplingParams(temperature=2.0), None),
        ],
        steps=6,
        target=3,
    )
    assert alone == again
    assert alone == crowded


def test_different_seeds_differ() -> None:
    p = SamplingParams(temperature=1.0)
    a = _draw_steps([(p, seeded(1))], steps=10, target=0)
    b = _draw_steps([(p, seeded(2))], steps=10, target=0)
    assert a != b  # 10 draws from ~500 near-uniform tokens: a collision is astronomically unlikely


FILTERS = [
    SamplingParams(top_k=7),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.8),
    SamplingParams(temperature=1.5, top_k=12, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize(
    "params", FILTERS, ids=lambda p: f"k{p.top_k}-p{p.top_p}-minp{p.min_p}-t{p.temperature}"
)
def test_filters_never_leave_the_allowed_set(params: SamplingParams) -> None:
    batch, vocab = 32, 64
    logits = random_logits(batch, vocab, seed=3)
    # Mix in unfiltered rows so filtered and unfiltered rows share one vectorised pass.
    row_params = [params if i % 4 else SamplingParams() for i in range(batch)]
    allowed = [allowed_set(logits[i], p) for i, p in enumerate(row_params)]
    meta = build(row_params, vocab)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(20):
            out = Sampler()(logits, meta).sampled_token_ids.tolist()
            for i, tok in enumerate(out):
                assert tok in allowed[i], f"row {i} sampled {tok}, allowed {sorted(allowed[i])}"


DIST_CASES = [
    SamplingParams(),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.7),
    SamplingParams(min_p=0.15),
    SamplingParams(temperature=0.5, top_k=5, top_p=0.9),
]


@pytest.mark.parametrize(
    "params", DIST_CASES, ids=lambda p: f"k{p.top_k}-p{p.top_p}-minp{p.min_p}-t{p.temperature}"
)
def test_empirical_distribution_matches_renormalised_probs(params: SamplingParams) -> None:
    """Chi-square goodness of fit at significance 0.001 over 20,000 draws (fixed seed, so deterministic)."""
    vocab, draws = 8, 20_000
    row = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.3, -1.0, -2.0])
    allowed = allowed_set(row, params)
    scaled = row.double() / params.temperature
    expected_p = torch.zeros(vocab, dtype=torch.float64)
    idx = torch.tensor(sorted(allowed))
    expected_p[idx] = scaled[idx].softmax(-1)

    with torch.random.fork_rng():
        torch.manual_seed(1)
        out = Sampler()(row.expand(draws, vocab).contiguous(), build([params] * draws, vocab))
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab).double()

    assert counts[expected_p == 0].sum() == 0, "sampled a token the filters removed"
    expected = expected_p[idx] * draws
    chi2 = float(((counts[idx] - expected) ** 2 / expected).sum())
    dof = len(allowed) - 1
    assert dof >= 1
    assert chi2 < CHI2_CRIT_0_001[dof], f"chi2={chi2:.2f} with {dof} dof"


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0]] * 3)
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # no penalty: untouched even though it has history
        SamplingParams(presence_penalty=-1.0),  # negative presence rewards seen output tokens
    ]
    prompts = [[0, 1], [0, 1], [0, 1]]
    outputs = [[2, 2, 3], [2, 2, 3], [2, 2, 3]]
    meta = build(params, 5, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits, meta)
    expected = torch.tensor(
        [
            # 0: prompt, positive -> 2/2.   1: prompt, negative -> -1*2.
            # 2: output x2, positive -> 0.5/2 - 0.25*2 - 0.5.   3: output x1, negative -> -0.5*2 - 0.25 - 0.5.
            # 4: never seen -> unchanged.
            [1.0, -2.0, -0.75, -1.75, 1.0],
            [2.0, -1.0, 0.5, -0.5, 1.0],
            [2.0, -1.0, 1.5, 0.5, 1.0],
        ]
    )
    assert torch.allclose(got, expected), got

    # And greedy decoding sees the penalised logits: token 0 drops from 2.0 to 2/3, below token 4's 1.0.
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=3.0)]
    out = Sampler()(logits[:1], build(greedy, 5, prompts=[[0]], outputs=[[]]))
    assert out.sampled_token_ids.tolist() == [4]


def test_logprobs_are_raw_with_ranks_and_sampled_token_first() -> None:
    batch, vocab = 4, 40
    logits = random_logits(batch, vocab, seed=5)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(logprobs=0, temperature=0.0, repetition_penalty=5.0),
        SamplingParams(logprobs=3, top_k=4, temperature=0.3),
        SamplingParams(logprobs=5, presence_penalty=2.0, min_p=0.1),
    ]
    meta = build(params, vocab, prompts=[[1, 2]] * batch, outputs=[[3, 4, 5]] * batch)
    assert meta.max_num_logprobs == 5
    out = Sampler()(logits, meta)
    assert out.logprobs is not None
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == lp.ranks.shape == (batch, 6)

    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs, raw.gather(1, lp.token_ids))
    top = raw.topk(5, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    assert lp.ranks[:, 1:].tolist() == [[1, 2, 3, 4, 5]] * batch
    for i in range(batch):
        rank = 1 + int((raw[i] > raw[i, sampled[i]]).sum())  # no ties in random logits
        assert int(lp.ranks[i, 0]) == rank

    entries = lp.to_entries([p.logprobs for p in params])
    assert entries[0] is None
    assert [len(e.token_ids) for e in entries[1:] if e is not None] == [1, 4, 6]
    e = entries[2]
    assert e is not None
    assert e.token_ids[0] == int(sampled[2]) and e.ranks[1:] == [1, 2, 3]
    assert e.logprobs == pytest.approx(raw[2].gather(0, torch.tensor(e.token_ids)).tolist())


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    vocab, eos, stop = 10, 9, 4
    logits = torch.zeros(3, vocab)
    logits[:, eos] = 10.0
    logits[:, stop] = 9.0
    logits[:, 2] = 8.0
    params = [SamplingParams(temperature=0.0, min_tokens=3) for _ in range(3)]
    for p in params:
        p._all_stop_token_ids = {eos, stop, 10_000}  # ids outside the vocab are ignored
    outputs = [[1], [1, 1, 1], [1, 1]]  # below, at, below min_tokens
    meta = build(params, vocab, outputs=outputs)
    assert meta.min_tokens_mask is not None
    assert sorted(zip(*(t.tolist() for t in meta.min_tokens_mask), strict=True)) == [
        (0, 4),
        (0, 9),
        (2, 4),
        (2, 9),
    ]
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [2, eos, 2]

    # Random rows too: with the stop ids masked they can never be drawn.
    rand = [SamplingParams(min_tokens=5) for _ in range(64)]
    for p in rand:
        p._all_stop_token_ids = {eos, stop}
    out = Sampler()(logits[:1].expand(64, vocab), build(rand, vocab)).sampled_token_ids
    assert not set(out.tolist()) & {eos, stop}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_min_tokens_without_the_copy_is_the_masked_argmax(dtype: torch.dtype) -> None:
    """The CPU's greedy path under min_tokens (sampler.py _greedy_under_min_tokens) picks what the argmax of the
    masked copy picks: rows whose best token is forbidden, rows tied with a forbidden token, NaN rows."""
    from pagedllm.sample.greedy_argmax import greedy_argmax
    from pagedllm.sample.sampler import apply_min_tokens

    vocab, stops = 9000, [3, 8999, 4000]
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(40, vocab, generator=gen).to(dtype)
    logits[0:10, 3] = 50.0  # forbidden best for rows still under min_tokens
    logits[10:20, 4000], logits[10:20, 4001] = 60.0, 60.0  # a tie whose first index is forbidden
    logits[20, 8999] = float("nan")  # a forbidden NaN
    logits[21, 5], logits[21, 8999] = float("nan"), float("nan")
    params = [SamplingParams(temperature=0.0, min_tokens=4) for _ in range(40)]
    for p in params:
        p._all_stop_token_ids = set(stops)
    outputs = [[1] * (i % 6) for i in range(40)]  # rows with 4 or 5 outputs are past min_tokens
    meta = build(params, vocab, outputs=outputs)
    assert meta.min_tokens_mask is not None and meta.all_greedy
    want = greedy_argmax(apply_min_tokens(logits, meta))
    before = logits.clone()
    got = Sampler()(logits, meta).sampled_token_ids
    assert torch.equal(logits.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       before.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # not modified
    assert got.tolist() == want.tolist()
    assert set(got[[i for i in range(40) if i % 6 < 4]].tolist()).isdisjoint(stops)


def test_disabled_features_cost_nothing() -> None:
    params = [SamplingParams(), SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3)]
    meta = build(params, 32, generators=[None, seeded(0)], outputs=[[1, 2], [3]])
    # The greedy row's filters and generator are irrelevant, so nothing is switched on.
    assert meta.no_top_k and meta.no_top_p and meta.no_min_p and meta.no_penalties
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.prompt_token_ids is None and meta.output_token_ids is None
    assert meta.generators == {} and meta.max_num_logprobs is None and meta.min_tokens_mask is None
    assert not meta.all_greedy and not meta.all_random
    assert build([SamplingParams(temperature=0.0)], 32).all_greedy
    assert build([SamplingParams(top_k=32)], 32).no_top_k  # k >= vocab is no filter at all
