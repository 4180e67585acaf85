"""The sampling fields clients send, offline: logit_bias, allowed_token_ids, bad_words, prompt_logprobs,
truncate_prompt_tokens, min_tokens with ignore_eos, and the ValueErrors vLLM's LLM.generate raises.

References nobody here wrote: transformers' forward pass (log_softmax) on the same tiny random Llama weights
for prompt logprobs; the plain greedy run for what a bias or a restriction must change.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_greedy, make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.engine.input_processing import complete_params
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler

PROMPT = list(range(3, 40))  # 37 tokens: several chunks at the small step budget below
EOS = 2  # tiny_models' eos_token_id
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_root: Path) -> str:
    return make_tiny_model("llama", tiny_root)


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    # A 16-token step budget: PROMPT is prefilled in three chunks; blocks of 4 so prefixes get cached.
    return LLM(model_dir, num_threads=1, block_size=4, max_num_batched_tokens=16, max_model_len=128)


def _tokens(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return list(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids)


@functools.cache
def _hf_model(model_dir: str) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    model = _hf_model(model_dir)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt]), use_cache=False).logits[0].float(), dim=-1)


def test_prompt_logprobs_equal_transformers_with_chunked_prefill_and_prefix_caching(llm: LLM, model_dir: str) -> None:
    ref = _hf_prompt_logprobs(model_dir, PROMPT)  # row j predicts PROMPT[j + 1]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    # Twice: the second run's prompt is in the prefix cache, which a prompt-logprobs request must not use.
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(PROMPT) and plp[0] is None
        for pos in range(1, len(PROMPT)):
            entry = plp[pos]
            assert entry is not None
            row = ref[pos - 1]
            actual = PROMPT[pos]
            assert entry[actual].logprob == pytest.approx(float(row[actual]), abs=1e-4)
            assert entry[actual].rank == int((row >= row[actual]).sum())
            top = torch.topk(row, 3)  # the actual token plus the top 3 (it may be one of them)
            assert set(entry) == {actual, *top.indices.tolist()}
            for rank, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), start=1):
                assert entry[t].logprob == pytest.approx(lp, abs=1e-4)
                assert t == actual or entry[t].rank == rank
        assert out.num_cached_tokens == 0
    # A plain request after them does use the cache those runs filled.
    plain = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert plain[0].num_cached_tokens > 0 and plain[0].prompt_logprobs is None


def test_prompt_logprobs_with_n_samples_and_zero_top(llm: LLM, model_dir: str) -> None:
    ref = _hf_prompt_logprobs(model_dir, PROMPT[:9])
    out = llm.generate({"prompt_token_ids": PROMPT[:9]},
                       SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 9
    for pos in range(1, 9):
        entry = out.prompt_logprobs[pos]
        assert entry is not None and list(entry) == [PROMPT[pos]]  # top-0: only the actual token
        assert entry[PROMPT[pos]].logprob == pytest.approx(float(ref[pos - 1, PROMPT[pos]]), abs=1e-4)


def test_logit_bias_moves_the_greedy_token(llm: LLM) -> None:
    plain = _tokens(llm, PROMPT[:8], GREEDY)
    first = plain[0]
    banned = _tokens(llm, PROMPT[:8], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                     logit_bias={first: -100.0}))
    assert first not in banned
    forced = _tokens(llm, PROMPT[:8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                     logit_bias={77: 100.0}))
    assert forced == [77] * 4


def test_allowed_token_ids_restrict_greedy_and_random_rows(llm: LLM) -> None:
    allowed = [11, 12, 13]
    greedy = _tokens(llm, PROMPT[:8], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                     allowed_token_ids=allowed))
    assert set(greedy) <= set(allowed)
    outs = llm.generate([{"prompt_token_ids": PROMPT[:8]}] * 3,
                        SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
                        use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
    # Rows without the field in the same batch are untouched.
    mixed = llm.generate([{"prompt_token_ids": PROMPT[:8]}] * 2,
                         [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
                          GREEDY], use_tqdm=False)
    assert list(mixed[1].outputs[0].token_ids) == _tokens(llm, PROMPT[:8], GREEDY)


def test_min_tokens_masks_eos_even_with_ignore_eos(llm: LLM) -> None:
    # A +100 bias makes EOS the greedy choice at every step; min_tokens must still hold it back.
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, ignore_eos=True, logit_bias={EOS: 100.0})
    tokens = _tokens(llm, PROMPT[:8], params)
    assert EOS not in tokens[:4] and tokens[4:] == [EOS, EOS]


def test_min_tokens_mask_holds_eos_with_ignore_eos_in_the_metadata() -> None:
    params = complete_params(SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[5]),
                             4, 64, {EOS})
    assert params.all_stop_token_ids == {5}  # EOS does not stop the request ...
    meta = SamplingMetadata.build([params], [None], [[1]], [[7]], 16, torch.device("cpu"))
    assert meta.min_tokens_mask is not None  # ... but it is held back until min_tokens
    assert sorted(meta.min_tokens_mask[1].tolist()) == [EOS, 5]


def test_bad_words_ban_a_sequence_after_its_prefix() -> None:
    vocab = 10
    logits = torch.zeros(3, vocab)
    logits[:, 4] = 5.0  # everyone's favourite
    logits[:, 6] = 4.0
    params = [SamplingParams(temperature=0.0) for _ in range(3)]
    params[0]._bad_words_token_ids = [[3, 4]]  # banned after a 3
    params[1]._bad_words_token_ids = [[3, 4]]
    params[2]._bad_words_token_ids = [[4], [9, 9, 6]]
    outputs = [[1, 3], [3, 1], [9, 9]]
    meta = SamplingMetadata.build(params, [None] * 3, [[0]] * 3, outputs, vocab, torch.device("cpu"))
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [6, 4, 0]
    # Rows without bad words build no mask at all.
    plain = SamplingMetadata.build([SamplingParams()], [None], [[0]], [[3]], vocab, torch.device("cpu"))
    assert plain.bad_words_mask is None and plain.no_token_edits


def test_truncate_prompt_tokens_keeps_the_end(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                                    truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT[-5:]
    assert list(out.outputs[0].token_ids) == _tokens(llm, PROMPT[-5:], SamplingParams(temperature=0.0, max_tokens=4,
                                                                                       ignore_eos=True))


def test_greedy_matches_transformers_with_the_fields_unused(llm: LLM, model_dir: str) -> None:
    # The features switched off cost nothing and change nothing.
    (expected, _), = hf_greedy(model_dir, [PROMPT[:8]], 6)
    assert _tokens(llm, PROMPT[:8], GREEDY) == expected


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        (list(range(3, 200)), SamplingParams(max_tokens=2), "maximum context length is 128"),
        ([], SamplingParams(max_tokens=2), "empty"),
        ([3, 10**6], SamplingParams(max_tokens=2), r"prompt token ids must be in \[0, 384\)"),
        ([3, 4], SamplingParams(stop_token_ids=[384]), "stop_token_ids"),
        ([3, 4], SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        ([3, 4], SamplingParams(allowed_token_ids=[1, 999]), "allowed_token_ids"),
        ([3, 4], SamplingParams(truncate_prompt_tokens=1000), "truncate_prompt_tokens"),
        ([3, 4], SamplingParams(bad_words=["x"]), "bad_words needs a tokenizer"),
    ],
)
def test_generate_raises_value_error_before_running(llm: LLM, prompt: list[int], params: SamplingParams,
                                                    match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the good prompt before it was not left queued


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)


def test_prompt_logprobs_and_token_edits_through_the_pipelined_step(model_dir: str, llm: LLM) -> None:
    # async_scheduling runs execute_pipelined (model_runner NOTE 1): the CPU can run it too.
    piped = LLM(model_dir, num_threads=1, block_size=4, max_num_batched_tokens=16, max_model_len=128,
                async_scheduling=True)
    try:
        assert piped.engine.core.async_scheduling
        params = [SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2),
                  SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, allowed_token_ids=[20, 21]),
                  SamplingParams(temperature=0.0, max_tokens=5, min_tokens=3, ignore_eos=True,
                                 logit_bias={EOS: 100.0})]
        prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:8]}, {"prompt_token_ids": PROMPT[:6]}]
        got = piped.generate(prompts, params, use_tqdm=False)
        want = llm.generate(prompts, params, use_tqdm=False)
        assert got[0].prompt_logprobs is not None and want[0].prompt_logprobs is not None
        for a, b in zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None and a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)
        assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
        assert set(got[1].outputs[0].token_ids) <= {20, 21}
        assert EOS not in got[2].outputs[0].token_ids[:3]
    finally:
        piped.shutdown()


def test_a_steady_batch_reuses_the_fixed_masks_and_rebuilds_the_bad_words_one() -> None:
    cpu = torch.device("cpu")
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3], logit_bias={2: 1.5}),
              SamplingParams(temperature=0.0)]
    params[1]._bad_words_token_ids = [[5, 6]]
    first = SamplingMetadata.build(params, [None, None], [[0], [0]], [[1], [4]], 8, cpu)
    assert first.bad_words_mask is None  # the last output (4) is not the bad word's prefix (5)
    assert first.allowed_token_ids_mask is not None
    assert first.allowed_token_ids_mask.tolist() == [[True, False, False, False, True, True, True, True],
                                                     [False] * 8]
    assert first.logit_bias is not None and [t.tolist() for t in first.logit_bias] == [[0], [2], [1.5]]
    second = SamplingMetadata.build(params, [None, None], [[0], [0]], [[1, 2], [4, 5]], 8, cpu, reuse=first)
    assert second.allowed_token_ids_mask is first.allowed_token_ids_mask  # reused, not rebuilt
    assert second.bad_words_mask is not None and [t.tolist() for t in second.bad_words_mask] == [[1], [6]]


def _tiny_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["stop here, the stop word stops now"] * 8, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_stop_strings_wait_for_min_tokens_as_vllm() -> None:
    from pagedllm.detokenizer import IncrementalDetokenizer

    tok: Any = _tiny_tokenizer()
    ids = tok.encode("stop here, stop now")
    first_stop_end = len(tok.encode("stop"))
    def feed(detok: IncrementalDetokenizer) -> int:
        for n, t in enumerate(ids, start=1):
            if detok.update([t]) is not None:
                return n
        return 0

    assert feed(IncrementalDetokenizer(tok, [0], SamplingParams(stop=["stop"]))) == first_stop_end
    held = IncrementalDetokenizer(tok, [0], SamplingParams(stop=["stop"], min_tokens=first_stop_end))
    assert feed(held) > first_stop_end  # only the second "stop" ends it
    assert held.output_text == "stop here, "


def test_bad_words_tokenize_alone_and_after_a_space() -> None:
    from pagedllm.engine.input_processing import bad_words_token_ids

    tok: Any = _tiny_tokenizer()
    sequences = bad_words_token_ids(tok, ["stop", " here"])
    assert tok.encode("stop") in sequences and tok.encode("here") in sequences
    spaced = tok.encode(" stop")
    assert (spaced in sequences) == (len(spaced) == len(tok.encode("stop")) and spaced[0] != tok.encode("stop")[0])


def test_prompt_logprobs_survive_preemption(model_dir: str) -> None:
    # A KV cache too small for all three: requests are preempted and recomputed; their prompt logprobs, which
    # the recompute reports again, are kept once per position and still match transformers.
    small = LLM(model_dir, num_threads=1, block_size=4, max_num_batched_tokens=16, max_model_len=72,
                num_kv_blocks=26, admission_headroom_tokens=0)  # admit while blocks are free, preempt later
    try:
        prompts = [PROMPT, PROMPT[1:], PROMPT[2:]]
        outs = small.generate([{"prompt_token_ids": p} for p in prompts],
                              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=1),
                              use_tqdm=False)
        assert small.get_stats().num_preemptions > 0
        for prompt, out in zip(prompts, outs, strict=True):
            ref = _hf_prompt_logprobs(model_dir, prompt)
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
            for pos in range(1, len(prompt)):
                entry = out.prompt_logprobs[pos]
                assert entry is not None
                assert entry[prompt[pos]].logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
    finally:
        small.shutdown()
