"""BART (an encoder-decoder) against transformers' `generate`: greedy tokens of a mixed-length batch through
chunked prefill (also with async scheduling and with the flex backend); the encoder output's cross-attention
K/V in their own KV-cache group (the `cross_attention` manager): allocated once per request from the encoder
length, never grown, never a prefix hit, freed at finish and abort, driven by the conformance kit; preemption
under a tiny KV pool recomputes the same tokens; the scheduler's encoder budget; the profiling step's encoder
rows; the cross-attention pseudo-batch layout; vLLM's prompt spellings and their errors; the server (slow)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tool_models import make_tokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.api import CrossAttentionSpec, FullAttentionSpec
from pagedllm.engine.input_processing import RequestValidationError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.serialization import make_add_request, request_from_message
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.plugins.kvmanagers.cross_attention.manager import CrossAttentionManager
from pagedllm.plugins.kvmanagers.full_attention.manager import FullAttentionManager
from pagedllm.request import Request
from pagedllm.sampling_params import BeamSearchParams

BLOCK, NEW = 4, 24
SMALL: dict[str, Any] = {"num_threads": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _restore_threads() -> Iterator[None]:
    """The engines here set torch's process-wide thread count (num_threads 1); later modules get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2+2-layer BART over the byte-level test tokenizer (its <|im_end|> is eos and decoder start)."""
    import transformers

    path = tmp_path_factory.mktemp("bart") / "tiny-bart"
    tok = make_tokenizer()
    eos, bos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    config = transformers.BartConfig(
        vocab_size=len(tok), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
        scale_embedding=True, init_std=0.25,  # a wide init keeps greedy argmax clear of rounding
        bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, decoder_start_token_id=eos,
        forced_bos_token_id=None, forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).eval()
    with torch.no_grad():  # BART initialises this bias to zeros; random values make the test see it
        model.final_logits_bias.normal_(0.0, 0.5)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(model_dir: str) -> Any:
    import transformers

    return transformers.BartForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


_HF_CACHE: dict[tuple[int, tuple[int, ...], tuple[int, ...], int], list[int]] = {}


def _hf_generate(hf_model: Any, encoder_ids: list[int], decoder_ids: list[int], new: int = NEW) -> list[int]:
    """transformers' greedy generate (num_beams=1, do_sample=False), EOS not stopping it (our ignore_eos);
    each (model, prompt) is generated once per session (several tests compare against the same prompts)."""
    key = (id(hf_model), tuple(encoder_ids), tuple(decoder_ids), new)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _hf_generate_uncached(hf_model, encoder_ids, decoder_ids, new)
    return _HF_CACHE[key]


def _hf_generate_uncached(hf_model: Any, encoder_ids: list[int], decoder_ids: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids]),
            max_new_tokens=new, min_new_tokens=new, num_beams=1, do_sample=False, eos_token_id=None,
            forced_bos_token_id=None, forced_eos_token_id=None,
        )
    return [int(t) for t in out[0, len(decoder_ids):]]


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    # Budget 16 < the longer prompts' decoder ids: prefills are chunked and share steps with decodes.
    return LLM(model_dir, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=256, **SMALL)


def _tok(model_dir: str) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


# (prompt as the user writes it, encoder ids, decoder ids as transformers gets them)
def _cases(model_dir: str) -> list[tuple[Any, list[int], list[int]]]:
    tok = _tok(model_dir)
    start = tok.convert_tokens_to_ids("<|im_end|>")
    text = "The quick brown fox jumps over the lazy dog, twice."
    long_ids = [(7 * i + 3) % 250 for i in range(37)]
    return [
        (text, tok(text).input_ids, [start]),  # a plain string: the encoder prompt, decoder start token
        ({"encoder_prompt": {"prompt_token_ids": long_ids}, "decoder_prompt": [start, 65, 66, 67, 68, 69, 70]},
         long_ids, [start, 65, 66, 67, 68, 69, 70]),
        ({"encoder_prompt": "hi", "decoder_prompt": {"prompt_token_ids": [80, 81, 82]}},  # start prepended
         tok("hi").input_ids, [start, 80, 81, 82]),
        ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], list(range(5, 22)), [start]),
        # A decoder prompt longer than the step budget: its encoder runs with the first chunk only.
        ({"encoder_prompt": [30, 31, 32, 33, 34], "decoder_prompt": [start, *range(100, 120)]},
         [30, 31, 32, 33, 34], [start, *range(100, 120)]),
    ]


def test_the_reference_depends_on_the_encoder(model_dir: str, hf_model: Any) -> None:
    """Guard for the match below: another encoder prompt changes transformers' tokens (cross-attention counts)."""
    _, enc, dec = _cases(model_dir)[1]
    assert _hf_generate(hf_model, enc, dec) != _hf_generate(hf_model, enc[:-5], dec)


def test_greedy_matches_transformers_in_one_mixed_batch(model_dir: str, hf_model: Any, llm: LLM) -> None:
    cases = _cases(model_dir)
    managers = llm.engine.parts.kv_cache_manager.coordinator.managers
    assert [type(m) for m in managers] == [FullAttentionManager, CrossAttentionManager]
    outputs = llm.generate([prompt for prompt, _, _ in cases], GREEDY, use_tqdm=False)
    for out, (_, enc, dec) in zip(outputs, cases, strict=True):
        assert out.prompt_token_ids == dec
        assert out.outputs[0].token_ids == _hf_generate(hf_model, enc, dec)
    assert llm.engine.kv_cache_usage == 0.0


def test_another_backend_reads_the_cross_layout_unchanged(model_dir: str, hf_model: Any) -> None:
    """The cross-attention pseudo-batch is plain paged-attention metadata: FlexAttention's backend serves it too."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    cases = _cases(model_dir)[1:3]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    flex = LLM(model_dir, block_size=BLOCK, max_num_batched_tokens=16, num_kv_blocks=128, attention_backend="flex",
               **SMALL)
    outputs = flex.generate([prompt for prompt, _, _ in cases], params, use_tqdm=False)
    for out, (_, enc, dec) in zip(outputs, cases, strict=True):
        assert out.outputs[0].token_ids == _hf_generate(hf_model, enc, dec, new=8)
    assert flex.engine.kv_cache_usage == 0.0


def test_no_prefix_hit_across_encoder_prompts(model_dir: str, hf_model: Any, llm: LLM) -> None:
    """Two requests with one decoder prompt under different encoder prompts: the second must not reuse the
    first's decoder blocks (their K/V depend on the encoder), so no group reports a hit (coordinator NOTE 1)."""
    engine: LLMEngine = llm.engine
    assert engine.parts.kv_cache_manager.enable_caching
    _, _, dec = _cases(model_dir)[-1]
    for rid, enc in (("a", [40, 41, 42, 43]), ("b", [50, 51, 52, 53])):
        engine.add_request(rid, {"encoder_prompt": enc, "decoder_prompt": dec}, GREEDY)
        requests = engine.core.scheduler.requests
        cached = None
        while engine.has_unfinished_requests():
            if rid in requests and requests[rid].num_cached_tokens >= 0:
                cached = requests[rid].num_cached_tokens
            for out in engine.step():
                if out.finished:
                    assert out.outputs[0].token_ids == _hf_generate(hf_model, enc, dec)
        assert cached == 0
    assert engine.kv_cache_usage == 0.0


def test_the_encoder_budget_spreads_encoders_over_steps(model_dir: str, hf_model: Any, llm: LLM) -> None:
    """Encoder prompts admitted in one step sum to at most max_num_batched_tokens (16), except the step's first
    (fcfs scheduler NOTE 3): 10 | 10 + 3 | 30, over three steps, with the same tokens as transformers."""
    engine: LLMEngine = llm.engine
    encoders = {"e0": list(range(10, 20)), "e1": list(range(20, 30)), "e2": [40, 41, 42], "e3": list(range(50, 80))}
    for rid, enc in encoders.items():
        engine.add_request(rid, {"encoder_prompt": enc}, GREEDY)
    requests = engine.core.scheduler.requests
    admitted: list[list[str]] = []
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        before = {rid for rid, r in requests.items() if r.num_computed_tokens > 0}
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        now = sorted(rid for rid, r in requests.items() if r.num_computed_tokens > 0 and rid not in before)
        if now:
            admitted.append(now)
    assert admitted == [["e0"], ["e1", "e2"], ["e3"]]
    start = engine.requests.limits.encoder_decoder.decoder_start_token_id  # type: ignore[union-attr]
    assert finished == {rid: _hf_generate(hf_model, enc, [start]) for rid, enc in encoders.items()}
    assert engine.kv_cache_usage == 0.0


def test_async_scheduling_gives_the_same_tokens(model_dir: str, hf_model: Any) -> None:
    """The pipelined step (step N+1 scheduled before N's tokens are known: model_runner NOTE 1) with the
    cross-attention layout built per step, on the CPU."""
    cases = _cases(model_dir)
    pipelined = LLM(model_dir, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=256,
                    async_scheduling=True, **SMALL)
    assert pipelined.engine.core.async_scheduling
    outputs = pipelined.generate([prompt for prompt, _, _ in cases], GREEDY, use_tqdm=False)
    for out, (_, enc, dec) in zip(outputs, cases, strict=True):
        assert out.outputs[0].token_ids == _hf_generate(hf_model, enc, dec)
    assert pipelined.engine.kv_cache_usage == 0.0


def test_cross_blocks_allocated_once_and_freed_at_finish(model_dir: str, llm: LLM) -> None:
    engine: LLMEngine = llm.engine
    self_attn, cross = engine.parts.kv_cache_manager.coordinator.managers
    cases = _cases(model_dir)
    encoder_len = {str(i): len(enc) for i, (_, enc, _) in enumerate(cases)}
    first_blocks: dict[str, list[int]] = {}
    for rid, (prompt, _, _) in enumerate(cases):
        engine.add_request(str(rid), prompt, GREEDY)
    requests = engine.core.scheduler.requests
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
                assert not cross.get_blocks(out.request_id) and not self_attn.get_blocks(out.request_id)
        for rid, request in requests.items():
            ids = [b.block_id for b in cross.get_blocks(rid)]
            if not ids:
                continue
            # Sized from the encoder, whatever the decoder's length; the same blocks every step.
            assert len(ids) == math.ceil(encoder_len[rid] / BLOCK)
            assert first_blocks.setdefault(rid, ids) == ids
            assert len(self_attn.get_blocks(rid)) == math.ceil(request.num_computed_tokens / BLOCK)
    assert finished == set(encoder_len) and set(first_blocks) == finished
    pool: BlockPool = engine.parts.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1 and engine.kv_cache_usage == 0.0
    assert not cross.req_to_blocks and not self_attn.req_to_blocks


def test_abort_frees_the_cross_blocks(llm: LLM) -> None:
    engine: LLMEngine = llm.engine
    self_attn, cross = engine.parts.kv_cache_manager.coordinator.managers
    for rid in ("x", "y"):
        engine.add_request(rid, {"encoder_prompt": list(range(60, 90))}, GREEDY)
    for _ in range(3):
        engine.step()
    assert len(cross.get_blocks("x")) == len(cross.get_blocks("y")) == math.ceil(30 / BLOCK)
    engine.abort_request(["x"])
    assert not cross.get_blocks("x") and not self_attn.get_blocks("x") and cross.get_blocks("y")
    while engine.has_unfinished_requests():
        engine.step()
    assert not cross.req_to_blocks and engine.kv_cache_usage == 0.0


def test_preemption_recomputes_the_same_tokens(model_dir: str, llm: LLM) -> None:
    cases = _cases(model_dir) * 2
    prompts = [prompt for prompt, _, _ in cases]
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    # 64 blocks of 4 tokens: a request holds up to ~8 self-attention + ~10 cross blocks as it grows, so the 8
    # do not fit at once and running ones are preempted (capacity planning still admits one request with the
    # longest encoder prompt, 128 / 4 = 32 cross blocks, and a full decoder context beside it).
    tight = LLM(model_dir, block_size=BLOCK, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=32,
                admission_headroom_tokens=0, **SMALL)
    again = [o.outputs[0].token_ids for o in tight.generate(prompts, GREEDY, use_tqdm=False)]
    assert tight.engine.get_stats().num_preemptions > 0
    assert again == roomy and all(len(tokens) == NEW for tokens in again)
    assert tight.engine.kv_cache_usage == 0.0


def test_prompt_errors_name_the_field(model_dir: str, llm: LLM) -> None:
    with pytest.raises(RequestValidationError, match="encoder prompt is empty") as err:
        llm.generate({"encoder_prompt": [], "decoder_prompt": [1]}, GREEDY, use_tqdm=False)
    assert err.value.param == "encoder_prompt"
    with pytest.raises(RequestValidationError, match="at most 128") as err:
        llm.generate(list(range(3, 200)), GREEDY, use_tqdm=False)
    assert err.value.param == "prompt"
    with pytest.raises(RequestValidationError, match="takes only") as err:
        llm.generate({"encoder_prompt": "a", "prompt": "b"}, GREEDY, use_tqdm=False)
    assert err.value.param == "prompt"
    with pytest.raises(RequestValidationError, match="needs 'encoder_prompt'"):
        llm.generate({"decoder_prompt": "b"}, GREEDY, use_tqdm=False)
    with pytest.raises(RequestValidationError, match="truncate_prompt_tokens is not supported") as err:
        llm.generate("hello", SamplingParams(max_tokens=2, truncate_prompt_tokens=2), use_tqdm=False)
    assert err.value.param == "truncate_prompt_tokens"
    with pytest.raises(RequestValidationError, match="beam search is not supported for encoder-decoder"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=4))
    assert llm.engine.kv_cache_usage == 0.0 and not llm.engine.has_unfinished_requests()


def test_a_decoder_only_model_refuses_the_encoder_decoder_spelling() -> None:
    from pagedllm.engine.encoder_decoder_prompt import split_prompt

    def tokenize(prompt: Any) -> tuple[str | None, list[int]]:
        return None, list(prompt)

    with pytest.raises(RequestValidationError, match="decoder-only") as err:
        split_prompt({"encoder_prompt": [1], "decoder_prompt": [2]}, None, tokenize, 10)
    assert err.value.param == "encoder_prompt"
    assert split_prompt([1, 2], None, tokenize, 10) == ([1, 2], None)


def test_the_encoder_prompt_crosses_the_process_boundary() -> None:
    request = Request("r", [2, 5], GREEDY, encoder_prompt_token_ids=[7, 8, 9])
    back = request_from_message(make_add_request(request))
    assert back.encoder_prompt_token_ids == [7, 8, 9] and back.num_encoder_tokens == 3
    assert back.prompt_token_ids == [2, 5]


def test_the_conformance_kit_drives_the_cross_attention_manager() -> None:
    """pagedllm.testing's random workload (admissions, chunked prefill, preemption, eviction) with encoder
    prompts: ref counts, free queue, idle requests holding nothing, the pool whole at the end."""
    from pagedllm.testing import check_kv_manager

    report = check_kv_manager("cross_attention")
    assert report.admissions > 50 and report.preemptions > 10 and report.allocation_failures > 0
    assert report.hit_blocks == 0  # never a prefix hit, by design


def test_cross_attention_manager_accounting() -> None:
    spec = CrossAttentionSpec(BLOCK, 2, 8, torch.float32, max_encoder_len=30)
    pool = BlockPool(32, enable_caching=True)
    manager = CrossAttentionManager(spec, pool, 1)
    assert manager.get_num_blocks_to_allocate("r", 10, []) == 3
    blocks = manager.allocate_new_blocks("r", 10)
    assert len(blocks) == 3 and manager.get_blocks("r") == blocks
    # Held: the same request asks again (every step does) and takes nothing.
    assert manager.get_num_blocks_to_allocate("r", 10, []) == 0 and manager.allocate_new_blocks("r", 10) == []
    with pytest.raises(RuntimeError, match="cannot change"):
        manager.allocate_new_blocks("r", 20)
    manager.cache_blocks("r", [b"h0", b"h1", b"h2"], 10)  # never registered
    assert manager.find_longest_cache_hit([b"h0", b"h1", b"h2"], 12) == []
    assert all(pool.get_cached_block(h, 1) is None for h in (b"h0", b"h1", b"h2"))
    manager.free("r")
    assert pool.get_num_free_blocks() == pool.num_blocks - 1 and pool.get_usage() == 0.0
    # Capacity planning: bounded by the encoder's position limit, whatever the decoder length.
    assert spec.max_blocks_per_request(10_000, 16) == math.ceil(30 / BLOCK)
    assert spec.tokens_to_hold(500, 7) == 7 and FullAttentionSpec(BLOCK, 2, 8, torch.float32).tokens_to_hold(500, 7) == 500
    with pytest.raises(ValueError, match="CrossAttentionSpec"):
        CrossAttentionManager(FullAttentionSpec(BLOCK, 2, 8, torch.float32), pool, 0)


@pytest.mark.slow
def test_server_completions_send_a_plain_prompt_to_the_encoder(
    model_dir: str, llm: LLM, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """/v1/completions through the official client: a plain prompt is the encoder prompt (the offline LLM's
    tokens), and an encoder prompt past the encoder's limit is a 400 naming `prompt`."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_server_support import live_server

    prompts = ["The quick brown fox", "hi there"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    offline = LLM.texts(llm.generate(prompts, params, use_tqdm=False))
    log = tmp_path_factory.mktemp("bart-server") / "server.log"
    with live_server(["--model", model_dir, "--served-model-name", "bart", "--block-size", str(BLOCK)], str(log)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", timeout=120, max_retries=0)
        resp = client.completions.create(model="bart", prompt=prompts, max_tokens=8, temperature=0)
        assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == offline
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="bart", prompt=list(range(3, 200)), max_tokens=4)
        assert err.value.body["param"] == "prompt" and "at most 128" in err.value.body["message"]


def test_the_cross_attention_pseudo_batch_layout() -> None:
    """worker/encoder_inputs.py's drawing on a two-request step (block size 4): r0 decodes (encoder of 3 in
    block 7), r1 starts with 2 decoder tokens (encoder of 5 in blocks 2, 9)."""
    from pagedllm.worker.encoder_inputs import plan_cross_attention

    encoder, common = plan_cross_attention(
        [[11, 12, 13], [21, 22, 23, 24, 25]], [5, 0], [1, 2], [[7], [2, 9]], BLOCK, torch.device("cpu")
    )
    # Pseudo-requests: one per decoder row (r0, r1, r1), then r1's encoder rows.
    assert common.query_start_loc_cpu.tolist() == [0, 1, 2, 3, 8]
    assert common.seq_lens_cpu.tolist() == [3, 5, 5, 5]
    assert common.block_table.tolist() == [[7, 0], [2, 9], [2, 9], [2, 9]]
    # Decoder rows write the null block's slot 0; r1's encoder positions 0..4 go to block 2, then block 9.
    assert common.slot_mapping.tolist() == [0, 0, 0, 8, 9, 10, 11, 36]
    assert (common.num_reqs, common.num_actual_tokens, common.max_query_len, common.num_decodes) == (4, 8, 5, 3)
    assert encoder.input_ids.tolist() == [21, 22, 23, 24, 25] and encoder.positions.tolist() == [0, 1, 2, 3, 4]
    assert encoder.query_start_loc_cpu.tolist() == [0, 5] and encoder.num_decoder_tokens == 3
    with pytest.raises(ValueError, match="needs a non-empty encoder prompt"):
        plan_cross_attention([[]], [0], [1], [[]], BLOCK, torch.device("cpu"))


def test_the_profiling_step_runs_the_encoders(llm: LLM) -> None:
    """The GPU's KV sizing runs the largest step once (worker/memory_profile.py); for an encoder-decoder model
    that step starts every sequence, so it carries every encoder too. Its layout and forward, on the CPU."""
    from pagedllm.worker.memory_profile import forward_profile_step, profile_batch, profile_step_inputs

    parts = llm.engine.parts
    model, runner = parts.model, parts.runner
    specs = model.kv_cache_specs()
    sizes = runner.block_sizes
    lens, tables = profile_batch(40, 16, sizes)  # 16 + 16 + 8 tokens
    inputs, cross = profile_step_inputs(model, specs, lens, tables, sizes[0], sizes, torch.device("cpu"))
    assert cross is not None and not inputs.extra_groups  # the cross group is laid out apart
    encoder, by_group = cross
    assert encoder.num_tokens == 40 and list(by_group) == [1]
    caches = [torch.zeros(runner.attn_backend.kv_cache_shape(40, s.block_size, s.num_kv_heads, s.head_size))
              for s in specs]
    with torch.inference_mode():
        hidden = forward_profile_step(model, runner.attn_backend, inputs, caches, cross)
    assert hidden.shape == (40, model.ctx.hf_config.d_model) and torch.isfinite(hidden).all()
