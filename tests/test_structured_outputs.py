"""Structured outputs offline: a random-weight model's garbage becomes valid JSON / regex / choice output only
through the grammar mask, so every check here fails without it. References: `jsonschema`, `re`, and
xgrammar's own bitmask kernel for the mask application; batching invariance against the same engine alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

from structured_models import tiny_model_with_tokenizer  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "nickname": {"type": "string", "maxLength": 4},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["id", "address", "tags", "active"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"sku": {"enum": ["a1", "b2", "c3"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}
SCHEMAS = [PERSON, NESTED, ITEMS]
PROMPTS = ["Describe a user as JSON:", "x", "The quick brown fox jumps over the lazy dog and then", "{"]
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe so"]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, block_size=4, structured_outputs_config={"disable_any_whitespace": True})


def _json(schema: dict[str, Any], **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 0.0), max_tokens=kw.pop("max_tokens", MAX_TOKENS),
                          structured_outputs=StructuredOutputsParams(json=schema, **kw.pop("so", {})), **kw)


def _assert_valid_json(completion: Any, schema: dict[str, Any]) -> None:
    assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
    jsonschema.validate(json.loads(completion.text), schema)


def _ids(outputs: list[Any]) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def test_json_schemas_validate_for_every_prompt(llm: LLM) -> None:
    for schema in SCHEMAS:
        greedy = llm.generate(PROMPTS, _json(schema), use_tqdm=False)
        sampled = llm.generate(PROMPTS[:2], [_json(schema, temperature=1.0, seed=i) for i in range(2)],
                               use_tqdm=False)
        for out in greedy + sampled:
            _assert_valid_json(out.outputs[0], schema)


def test_free_text_of_the_same_model_is_not_json(llm: LLM) -> None:
    """The control: without the mask these weights produce no JSON, so the test above proves the mask."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    for out in outs:
        with pytest.raises(ValueError):
            json.loads(out.outputs[0].text)


def test_regex_choice_json_object_and_grammar(llm: LLM) -> None:
    regex = SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                           structured_outputs=StructuredOutputsParams(regex=REGEX))
    choice = SamplingParams(temperature=1.0, seed=4, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    obj = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(
        json_object=True))
    ebnf = SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_outputs=StructuredOutputsParams(
        grammar='root ::= "id=" [0-9] [0-9]? " ok"'))
    # (json_object leaves key lengths open: most walks of random weights never close a key, so one prompt
    # known to finish here; the server test has more.)
    outs = llm.generate(PROMPTS[:2] * 3 + PROMPTS[:1], [regex, regex, choice, choice, ebnf, ebnf, obj],
                        use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert all(re.fullmatch(REGEX, t) for t in texts[:2]), texts
    assert all(t in CHOICES for t in texts[2:4]), texts
    assert all(re.fullmatch(r"id=[0-9]{1,2} ok", t) for t in texts[4:6]), texts
    assert isinstance(json.loads(texts[6]), dict), texts


def test_n_samples_each_follow_their_own_grammar(llm: LLM) -> None:
    params = _json(PERSON, temperature=1.0, seed=7, n=6)
    out = llm.generate(["Describe a user as JSON:"], params, use_tqdm=False)[0]
    assert len(out.outputs) == 6
    for completion in out.outputs:
        _assert_valid_json(completion, PERSON)
    assert len({c.text for c in out.outputs}) > 1  # six different walks, not one grammar state shared


def test_free_requests_unchanged_by_grammar_requests_and_prefix_cache(llm: LLM) -> None:
    """Greedy free requests give the same tokens beside grammar requests sharing their prefix (cached blocks),
    and the grammar requests the same as alone: the mask touches exactly its own rows."""
    prefix = "A shared system prompt that is long enough to fill several KV blocks of four tokens each. "
    free_prompts = [prefix + "Free one.", prefix + "Free two."]
    grammar_prompts = [prefix + "JSON one.", prefix + "JSON two."]
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone_free = _ids(llm.generate(free_prompts, free, use_tqdm=False))
    alone_json = _ids(llm.generate(grammar_prompts, _json(NESTED), use_tqdm=False))
    mixed = llm.generate([free_prompts[0], grammar_prompts[0], free_prompts[1], grammar_prompts[1]],
                         [free, _json(NESTED), free, _json(NESTED)], use_tqdm=False)
    ids = _ids(mixed)
    assert [ids[0], ids[2]] == alone_free
    assert [ids[1], ids[3]] == alone_json
    assert llm.engine.get_stats().prefix_cache_hits > 0


def test_chunked_prefill_and_preemption_keep_grammar_state(model_dir: str) -> None:
    prompts = [f"Request number {i}: " + "filler words " * (6 + i) for i in range(6)]
    params = [_json(SCHEMAS[i % 3]) for i in range(6)]
    roomy = LLM(model_dir, block_size=4, structured_outputs_config={"disable_any_whitespace": True})
    expected = roomy.generate(prompts, params, use_tqdm=False)
    roomy.engine.shutdown()
    # 48 blocks x 4 tokens for six growing requests: preemption by recompute; 16-token steps: chunked prompts.
    tight = LLM(model_dir, block_size=4, num_kv_blocks=48, max_num_seqs=6, max_num_batched_tokens=16,
                enable_prefix_caching=False, admission_headroom_tokens=0,
                structured_outputs_config={"disable_any_whitespace": True})
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.get_stats().num_preemptions > 0
    assert _ids(got) == _ids(expected)
    for i, out in enumerate(got):
        _assert_valid_json(out.outputs[0], SCHEMAS[i % 3])
    tight.engine.shutdown()


def test_speculative_ngram_drafts_are_verified_against_the_mask(model_dir: str, llm: LLM) -> None:
    """Greedy output is the same with ngram drafts (verification under each position's mask) as without."""
    prompts = ['{"sku":"a1","qty":1},{"sku":"a1","qty":1},{"sku":"a1",', "x", '{"name":"ab","age":1,"role":"user"}']
    params = [_json(ITEMS), _json(NESTED), _json(PERSON)]
    expected = _ids(llm.generate(prompts, params, use_tqdm=False))
    spec = LLM(model_dir, block_size=4, speculative_method="ngram", num_speculative_tokens=4,
               structured_outputs_config={"disable_any_whitespace": True})
    got = spec.generate(prompts, params, use_tqdm=False)
    assert _ids(got) == expected
    stats = spec.engine.get_stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    spec.engine.shutdown()


def test_draft_model_drafts_cut_by_the_grammar_keep_greedy_output(model_dir: str, llm: LLM) -> None:
    """A draft model's drafts are mostly not grammar-valid: they are cut to the valid prefix (with their
    probabilities) before verification, and greedy output is unchanged."""
    prompts = ["x", "Describe a user as JSON:"]
    params = [_json(NESTED), _json(PERSON)]
    expected = _ids(llm.generate(prompts, params, use_tqdm=False))
    spec = LLM(model_dir, block_size=4, speculative_method="draft", draft_model=model_dir, num_speculative_tokens=3,
               structured_outputs_config={"disable_any_whitespace": True})
    assert _ids(spec.generate(prompts, params, use_tqdm=False)) == expected
    assert spec.engine.get_stats().spec_num_draft_tokens > 0
    spec.engine.shutdown()


def test_async_scheduling_fills_grammar_masks_in_the_runner(model_dir: str, llm: LLM) -> None:
    """Pipelined steps keep running with grammar requests (manager.py NOTE 3): each step's masks are filled
    from the step before's ids after its forward is launched. Tokens, finish reasons and validity must equal
    the synchronous engine's, with free requests beside them, a grammar that ends early, and seeded n > 1."""
    prompts = ["Free text here", "x", "Another free one", "{", "Describe a user as JSON:"]
    params = [SamplingParams(temperature=0.0, max_tokens=20), _json(PERSON),
              SamplingParams(temperature=0.0, max_tokens=30), _json(ITEMS),
              _json(NESTED, temperature=1.0, seed=7, n=2)]
    sync = llm.generate(prompts, params, use_tqdm=False)
    pipelined = LLM(model_dir, block_size=4, async_scheduling=True, structured_outputs_config={"disable_any_whitespace": True})
    core = pipelined.engine.core
    assert core.async_scheduling and core._pipelined_grammars
    free_first = _ids(pipelined.generate(prompts[:1], params[:1], use_tqdm=False))  # pipelined, no grammar
    assert free_first == _ids(sync[:1])
    outs = pipelined.generate(prompts, params, use_tqdm=False)
    assert _ids(outs) == _ids(sync)
    assert [c.finish_reason for o in outs for c in o.outputs] == [c.finish_reason for o in sync for c in o.outputs]
    for out, schema in ((outs[1], PERSON), (outs[3], ITEMS), (outs[4], NESTED)):
        for completion in out.outputs:
            _assert_valid_json(completion, schema)
    assert not core._structured.grammars and not core._structured._pre_accepted
    pipelined.engine.shutdown()


@pytest.mark.slow
def test_tensor_parallel_pipelined_grammar_steps_equal_one_rank(model_dir: str, llm: LLM) -> None:
    """With tp = 2 and async scheduling, rank 0 fills the deferred masks and the remote rank receives none
    (it samples nothing): tokens equal the single-rank synchronous engine's."""
    prompts = ["x", "Describe a user as JSON:", "Free text here"]
    params = [_json(PERSON), _json(ITEMS), SamplingParams(temperature=0.0, max_tokens=16)]
    expected = llm.generate(prompts, params, use_tqdm=False)
    tp = LLM(model_dir, block_size=4, tensor_parallel_size=2, async_scheduling=True,
             structured_outputs_config={"disable_any_whitespace": True})
    assert tp.engine.core._pipelined_grammars
    outs = tp.generate(prompts, params, use_tqdm=False)
    tp.engine.shutdown()
    assert _ids(outs) == _ids(expected)
    _assert_valid_json(outs[0].outputs[0], PERSON)
    _assert_valid_json(outs[1].outputs[0], ITEMS)


def test_grammar_that_cannot_finish_ends_with_length(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}}, "required": ["s"]}
    out = llm.generate(["x"], _json(schema, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 6 and out.text.startswith('{"s"')


def test_invalid_constraints_fail_fast_naming_the_field(llm: LLM) -> None:
    cases = [
        (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
        (StructuredOutputsParams(regex="a[b"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="root ::= (", backend="xgrammar"), "structured_outputs"),
        (StructuredOutputsParams(structural_tag='{"x": 1}', backend="llguidance"), "structured_outputs"),
        (StructuredOutputsParams(regex="a", backend="nope"), "structured_outputs"),
    ]
    for so, field in cases:
        with pytest.raises(ValueError) as info:
            llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
        assert getattr(info.value, "param", "").startswith(field), (so, str(info.value))
        assert str(info.value).startswith("structured_outputs"), str(info.value)
    assert "no structured_output named 'nope'" in _error(llm, StructuredOutputsParams(regex="a", backend="nope"))


def _error(llm: LLM, so: StructuredOutputsParams) -> str:
    with pytest.raises(ValueError) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
    return str(info.value)


def test_lark_grammar_is_served_by_llguidance(llm: LLM) -> None:
    """xgrammar cannot parse Lark, so the selector passes it to llguidance (with the reason); forcing
    xgrammar is refused with xgrammar's parse error."""
    lark = 'start: "v" NUM "!"\nNUM: /[0-9]{1,3}/'
    out = llm.generate(["x"], SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                                             structured_outputs=StructuredOutputsParams(grammar=lark)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"v[0-9]{1,3}!", out.text), out.text
    assert "EBNF" in _error(llm, StructuredOutputsParams(grammar=lark, backend="xgrammar"))
    forced = llm.generate(PROMPTS[:2], _json(PERSON, so={"backend": "llguidance"}), use_tqdm=False)
    for o in forced:
        _assert_valid_json(o.outputs[0], PERSON)


def test_missing_backend_package_is_named(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.plugin_spec import PluginKind

    for spec in llm.engine.pm.components(PluginKind.STRUCTURED_OUTPUT):
        monkeypatch.setattr(spec, "requires", (f"{spec.name}_not_here",))
    message = _error(llm, StructuredOutputsParams(regex="a"))
    assert "package providing 'xgrammar_not_here' is not installed" in message
    assert "package providing 'llguidance_not_here' is not installed" in message


def test_engine_without_grammar_requests_builds_no_manager(model_dir: str) -> None:
    plain = LLM(model_dir, block_size=4)
    plain.generate(["x"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert plain.engine.core._structured is None  # no backend built, no thread pool, no per-step work
    plain.engine.shutdown()


def test_bitmask_application_matches_xgrammar_kernel() -> None:
    from pagedllm.structured_output.bitmask import allocate_bitmask, apply_bitmask

    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    logits = torch.randn(6, vocab, generator=gen)
    bitmask = allocate_bitmask(4, vocab)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int64).to(torch.int32))
    rows, mask_rows = [0, 2, 3, 5], [1, 0, 3, 2]
    expected = logits.clone()
    reference = expected[rows].contiguous()
    xgr.apply_token_bitmask_inplace(reference, bitmask[mask_rows].contiguous())
    expected[rows] = reference
    apply_bitmask(logits, bitmask, rows, mask_rows)
    assert torch.equal(logits, expected)
    # The accelerator's unpacking (shifts), run here on CPU tensors, against the same reference.
    from pagedllm.structured_output.bitmask import forbidden_by_shifts

    ones = torch.zeros(4, vocab)
    xgr.apply_token_bitmask_inplace(ones, bitmask)
    assert torch.equal(forbidden_by_shifts(bitmask, vocab), ones == float("-inf"))
