"""Speculative decoding keeps the target's output distribution exactly (rejection sampling).

Two levels, both chi-square tests at significance 1e-3 with fixed seeds (so they are deterministic):

- the rejection sampler alone, on a toy target and draft over 5 tokens with a huge batch: the first emitted
  token is distributed as p(.|()), and the second, given the first draft was accepted, as p(.|first); a
  sampler that ignores q (treats sampled drafts as one-hot) fails the same test, so the test has power;
- the engine, on a tiny model with an 8-token vocabulary: the joint distribution of the first three tokens
  generated with speculation (ngram, and a draft model) matches the one enumerated from transformers'
  forward pass on the same weights.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_config

from pagedllm import LLM, SamplingParams
from pagedllm.sample.rejection_sampler import draw_randoms, rejection_sample

ALPHA = 1e-3
V = 5


def _chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test; cells expected below 5 are pooled into one."""
    n = observed.sum()
    expected = expected_probs.double() * n
    small = expected < 5
    obs = torch.cat([observed[~small].double(), observed[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def _table(gen: torch.Generator, rows: int, sharp: float) -> torch.Tensor:
    return torch.softmax(sharp * torch.randn(rows, V, generator=gen, dtype=torch.float64), dim=-1).float()


@pytest.mark.parametrize("one_hot_claim", [False, True], ids=["with-q", "one-hot"])
def test_rejection_sampler_matches_target(one_hot_claim: bool) -> None:
    """With q: accept min(1, p/q), recover from norm(max(0, p - q)). One-hot (the n-gram rule): accept p(d),
    recover from p without d -- exact too, whatever produced d, only less often accepted."""
    gen = torch.Generator().manual_seed(0)
    # p(.|prefix) and q(.|prefix) for prefixes (), (x,), (x, y): row 0, 1 + x, 1 + V + x*V + y.
    p_table, q_table = _table(gen, 1 + V + V * V, 1.5), _table(gen, 1 + V + V * V, 1.5)
    batch, k = 200_000, 2
    d0 = torch.multinomial(q_table[0].expand(batch, V), 1, generator=gen).squeeze(1)
    d1 = torch.multinomial(q_table[1 + d0], 1, generator=gen).squeeze(1)
    drafts = torch.stack([d0, d1], dim=1)
    target = torch.stack([p_table[0].expand(batch, V), p_table[1 + d0], p_table[1 + V + d0 * V + d1]], dim=1)
    q = torch.stack([q_table[0].expand(batch, V), q_table[1 + d0]], dim=1)
    uniforms, noise = draw_randoms([k] * batch, V, {}, torch.device("cpu"))
    out = rejection_sample(
        drafts, torch.full((batch,), k), target.argmax(-1), target, None if one_hot_claim else q,
        torch.zeros(batch, dtype=torch.bool), uniforms, noise,
    )
    first = out.token_ids[:, 0]
    p_first = _chi_square_p(torch.bincount(first, minlength=V), p_table[0])
    second_ps = []
    for x in range(V):
        rows = (first == x) & (out.num_accepted >= 1)
        if rows.sum() >= 200:
            counts = torch.bincount(out.token_ids[rows, 1], minlength=V)
            second_ps.append(_chi_square_p(counts, p_table[1 + x]))
    assert p_first > ALPHA and min(second_ps) > ALPHA / V, (p_first, second_ps)
    assert (out.num_accepted == 2).any() and (out.num_accepted == 0).any()
    # Power: the drafts themselves (distributed as q) are told apart from p by the same test.
    assert _chi_square_p(torch.bincount(d0, minlength=V), p_table[0]) < ALPHA


def test_greedy_rejection_is_argmax_chain() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 4, 7, generator=gen)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :3].clone()
    drafts[::3, 1] = (drafts[::3, 1] + 1) % 7  # every third row: reject at position 1
    num_drafts = torch.full((64,), 3)
    num_drafts[::5] = 1
    out = rejection_sample(drafts, num_drafts, argmax, None, None, torch.ones(64, dtype=torch.bool),
                           torch.zeros(64, 3), torch.ones(64, 7))
    for b in range(64):
        a = int(out.num_accepted[b])
        expected_a = 1 if b % 3 == 0 and num_drafts[b] > 1 else int(num_drafts[b])
        assert a == expected_a
        assert out.token_ids[b, : a + 1].tolist() == argmax[b, : a + 1].tolist()
        assert (out.token_ids[b, a + 1 :] == -1).all()


# -- engine level --------------------------------------------------------------------------------------------

SMALL_V = 8
PROMPT = [3, 5, 3, 5, 3, 6, 3, 5, 3]  # repetitive: the n-gram proposer always finds something to propose


def _small_vocab_model(root: Path, name: str, seed: int) -> str:
    import transformers

    path = root / name
    if not (path / "config.json").exists():
        torch.manual_seed(seed)
        config = tiny_config("qwen3")
        config.vocab_size = SMALL_V
        config.initializer_range = 0.1  # softer logits: every continuation keeps some probability
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _exact_joint(model_dir: str, params: SamplingParams, length: int) -> torch.Tensor:
    """P(t_1..t_length | PROMPT) over all SMALL_V**length sequences, from transformers' forward, with the
    request's presence penalty (on the tokens output before), temperature and top-k applied per position."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    joint = torch.zeros([SMALL_V] * length, dtype=torch.float64)
    with torch.no_grad():
        for prefix in itertools.product(range(SMALL_V), repeat=length - 1):
            logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -length:].double()
            p = 1.0
            for j in range(length):  # row j: the token after prefix[:j]
                row = logits[j].clone()
                row[list(set(prefix[:j]))] -= params.presence_penalty
                row = row / params.temperature
                if params.top_k:
                    row[row < row.topk(params.top_k).values[-1]] = float("-inf")
                probs = torch.softmax(row, dim=-1)
                if j < length - 1:
                    p = p * probs[prefix[j]]
                else:
                    joint[prefix] = p * probs
    return joint.flatten()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Thousands of tiny per-request attention calls: thread hand-offs would cost more than they save."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("method", "top_k", "presence"), [("ngram", 0, 0.0), ("draft", 0, 0.0), ("ngram", 7, 0.5)],
                         ids=["ngram", "draft", "ngram-topk-penalty"])
def test_engine_distribution_matches_target(tiny_root: Path, method: str, top_k: int, presence: float) -> None:
    """Penalties and top-k change p at every draft position (the drafts before it count as output)."""
    target = _small_vocab_model(tiny_root, "qwen3_v8", seed=0)
    temperature, length, num = 0.9, 3, 2000
    kwargs: dict = {"speculative_method": method, "num_speculative_tokens": 2, "max_num_seqs": 256}
    if method == "draft":
        kwargs["draft_model"] = _small_vocab_model(tiny_root, "qwen3_v8_draft", seed=1)
    llm = LLM(target, block_size=4, max_num_batched_tokens=1024, **kwargs)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=length, ignore_eos=True, top_k=top_k,
                             presence_penalty=presence) for i in range(num)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * num, params, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.spec_num_draft_tokens > num // 2  # the later tokens really went through verification
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    counts = torch.zeros(SMALL_V**length)
    for o in outs:
        ids = o.outputs[0].token_ids
        assert len(ids) == length
        counts[sum(t * SMALL_V ** (length - 1 - j) for j, t in enumerate(ids))] += 1
    p_value = _chi_square_p(counts, _exact_joint(target, params[0], length))
    assert p_value > ALPHA, p_value
