"""Sampling, stop conditions, logprobs and the text path, on the embedded default model (real tokenizer)."""

from __future__ import annotations

import math

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "List three colors:", "def add(a, b):"]


@pytest.fixture(scope="module")
def llm(default_gguf: str) -> LLM:
    return LLM(default_gguf, max_num_batched_tokens=128)


def _texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    first = llm.generate(PROMPTS, p, use_tqdm=False)
    # Same seed, different neighbours in the batch: the same tokens.
    others = [SamplingParams(temperature=1.0, max_tokens=5), p, SamplingParams(temperature=0.5, seed=9, max_tokens=7)]
    second = llm.generate(["Hello there", PROMPTS[0], "Why?"], others, use_tqdm=False)
    assert second[1].outputs[0].token_ids == first[0].outputs[0].token_ids
    third = llm.generate(PROMPTS, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in third] == [o.outputs[0].token_ids for o in first]


def test_top_k_1_equals_greedy(llm: LLM) -> None:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    topk1 = llm.generate(PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=16, seed=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in topk1] == [o.outputs[0].token_ids for o in greedy]


def test_stop_string_cuts_text_and_ends_request(llm: LLM) -> None:
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert len(text) > 12
    stop = text[6:10]  # a span that may straddle token boundaries
    cut = text[: text.index(stop)]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.text == cut
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    kept = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert kept.outputs[0].text == cut + stop
    assert llm.engine.kv_cache_usage == 0.0


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    ids = base.outputs[0].token_ids
    assert len(ids) == 10 and base.outputs[0].finish_reason == "length"
    stop_id = ids[4]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    first = ids.index(stop_id)
    assert out.outputs[0].token_ids == ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_logprobs_are_consistent(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    total = 0.0
    for tid, position in zip(comp.token_ids, comp.logprobs):
        assert tid in position
        assert position[tid].rank == 1  # greedy picks the most likely token
        lps = [lp.logprob for lp in position.values()]
        assert all(v <= 0 for v in lps) and len(position) <= 4
        assert max(lps) == position[tid].logprob
        assert position[tid].decoded_token is not None
        total += position[tid].logprob
    assert comp.cumulative_logprob is not None and math.isclose(comp.cumulative_logprob, total, rel_tol=1e-5)


def test_chat_uses_the_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.chat_template
    rendered = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == tok(rendered, add_special_tokens=False).input_ids
    assert out.outputs[0].text.strip()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_output_kinds_cumulative_delta_final_only(llm: LLM) -> None:
    """Stepping the engine: CUMULATIVE grows, DELTA pieces add up to the final output, FINAL_ONLY says nothing
    until the request ends; all three end with the same tokens and text as `generate`."""
    from pagedllm.sampling_params import RequestOutputKind

    expected = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    engine = llm.engine
    seen: dict[RequestOutputKind, list] = {}
    for kind in RequestOutputKind:
        rid = f"kind-{kind.name}"
        engine.add_request(rid, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, output_kind=kind))
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == rid]
        seen[kind] = outs
    cumulative = seen[RequestOutputKind.CUMULATIVE]
    assert len(cumulative) == 12 and [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 13))
    assert cumulative[-1].outputs[0].token_ids == expected.token_ids and cumulative[-1].outputs[0].text == expected.text
    delta = seen[RequestOutputKind.DELTA]
    assert len(delta) == 12 and all(len(o.outputs[0].token_ids) == 1 for o in delta)
    assert [t for o in delta for t in o.outputs[0].token_ids] == expected.token_ids
    assert "".join(o.outputs[0].text for o in delta) == expected.text
    final = seen[RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == expected.token_ids
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)  # type: ignore[arg-type]
