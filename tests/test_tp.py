"""Tensor parallelism on the CPU: tp=2 over gloo (rank 0 here, rank 1 a spawned process) against tp=1.

References: transformers' float32 greedy loop on the same checkpoint (tests/tiny_models.py) and our own
tp=1 engine. Cases cover the head layouts that shard differently:

    llama_kv2   4 query heads, 2 KV heads   -> each rank holds 2 q heads and 1 KV head (KV split)
    qwen2_kv1   4 query heads, 1 KV head    -> each rank holds 2 q heads and a copy of the KV head
                (q/k/v biases, tied embeddings, vocab 383: padded to 384 so it splits over 2 ranks)

and every loader: hf (safetensors), gguf (a tiny file written with gguf-py, dequantized at load) and dummy
(random weights that are the same at any tp: each rank draws the full tp=1 tensor and keeps its slice).
Processes are slow to start, so each case builds one tp=2 engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tiny_models import hf_greedy, tiny_config

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.distributed.shard_check import check_tensor_parallel
from pagedllm.protocols.executor import WorkerDiedError
from pagedllm.selector import SelectionError

PROMPTS = [[1, 5, 9, 33, 70, 11, 250, 17, 3], [1, 100, 200, 300], [1, 42, 42, 42, 42, 42, 42, 7, 8, 9, 10]]
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# Small blocks: prompts span several blocks, so block tables and slot mapping are exercised on every rank.
ENGINE = dict(device="cpu", block_size=4, kv_cache_memory_gb=0.01, enable_prefix_caching=True)


def tp_config(kind: str) -> Any:
    if kind == "llama_kv2":
        return tiny_config("llama")
    if kind == "qwen2_kv1":
        cfg = tiny_config("qwen2")
        cfg.num_key_value_heads = 1
        cfg.vocab_size = 383
        cfg.tie_word_embeddings = True
        return cfg
    raise ValueError(kind)


def save_model(kind: str, root: Path) -> str:
    path = root / f"tp-{kind}"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        cfg = tp_config(kind)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(path, safe_serialization=True)
    return str(path)


def generate(model: str, tp: int, **kwargs: Any) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, tensor_parallel_size=tp, **ENGINE, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def assert_dead_rank_fails_the_next_step(llm: LLM) -> None:
    """Kill rank 1's process: the next step must fail with an error naming it."""
    executor: Any = llm.engine.parts.executor
    worker = executor._procs[0]
    worker.kill()
    worker.join(timeout=10)
    with pytest.raises(WorkerDiedError, match=r"tensor-parallel rank 1 \(pid \d+\) exited"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)


@pytest.mark.slow  # starts a rank-1 process
@pytest.mark.parametrize("kind", ["llama_kv2", "qwen2_kv1"])
def test_tp2_greedy_equals_tp1_and_transformers(kind: str, tiny_root: Path) -> None:
    model = save_model(kind, tiny_root)
    expected = [tokens for tokens, _ in hf_greedy(model, PROMPTS, MAX_TOKENS)]
    tp1, llm1 = generate(model, 1)
    kv_heads_tp1 = llm1.engine.parts.runner.kv_caches[0].shape[-2]
    llm1.shutdown()
    tp2, llm2 = generate(model, 2)
    try:
        parts = llm2.engine.parts
        assert parts.selections["executor"].winner.name == "multiproc"
        # Rank 0's KV cache holds its own heads only: half of llama's 2, and qwen2's single head replicated.
        assert parts.runner.kv_caches[0].shape[-2] == 1
        assert kv_heads_tp1 == (2 if kind == "llama_kv2" else 1)
    finally:
        llm2.shutdown()
    assert tp1 == expected
    assert tp2 == expected


@pytest.mark.slow  # starts a rank-1 process
@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_tp2_gguf_equals_tp1(quantization: str | None, tmp_path: Path) -> None:
    """Dequantized at load (the layers slice dense tensors) and kept in GGUF blocks (the method slices blocks:
    rows of column-parallel pieces and of the padded vocabulary, whole blocks of row-parallel columns)."""
    from test_gguf_loader import tiny_hf_weights, write_tiny_gguf

    path = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(path, "llama", tiny_hf_weights("llama"))  # Q8_0, Q4_0, F16 and F32 tensors; vocab 261
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [t % 261 for t in p]} for p in PROMPTS]  # the file's vocabulary
    with LLM(str(path), quantization=quantization, **ENGINE) as llm1:
        ref = [o.outputs[0] for o in llm1.generate(prompts, params, use_tqdm=False)]
    with LLM(str(path), tensor_parallel_size=2, quantization=quantization, **ENGINE) as llm2:
        tp2 = [list(o.outputs[0].token_ids) for o in llm2.generate(prompts, params, use_tqdm=False)]
    assert all(len(t) == MAX_TOKENS for t in tp2)
    if quantization is None:  # float32 throughout: the split changes rounding only
        assert tp2 == [list(o.token_ids) for o in ref]
        return
    # The CPU kernels of the kept blocks multiply in bfloat16 (Int4PackKernel, GroupInt8Kernel), and a
    # row-parallel layer rounds each rank's partial sum before the all-reduce: sequences agree until a step
    # where tp=1's top two tokens are within bfloat16 noise, and there tp=2 picks the runner-up. The gap seen
    # is 0.25: one bfloat16 step for logits of magnitude 32..64, as this std-1 random model's are.
    for out, tokens in zip(ref, tp2):
        agree = next((i for i, (a, b) in enumerate(zip(out.token_ids, tokens)) if a != b), len(tokens))
        assert agree >= 3, (out.token_ids, tokens)
        if agree < len(tokens):
            top = out.logprobs[agree]  # type: ignore[index]
            assert tokens[agree] in top, (agree, top)
            assert abs(top[out.token_ids[agree]].logprob - top[tokens[agree]].logprob) <= 0.25 + 1e-6


@pytest.mark.slow  # starts a rank-1 process
@pytest.mark.parametrize("method", ["awq", "gptq", "gptq_act_order", "fp8"])
def test_tp2_quantized_checkpoints_equal_tp1(method: str, tiny_root: Path) -> None:
    """Packed formats shard as packed tensors: AWQ/GPTQ qweight/qzeros/scales by rows or whole groups of
    columns (GPTQ act-order: every rank keeps the whole scales/zeros and its slice of g_idx), compressed-tensors
    FP8 weights with their per-channel scales. Greedy tp=2 == tp=1 (float32)."""
    from quant_packers import write_quantized_llama
    from test_quant_fp8 import ct_checkpoint
    from tiny_models import make_tiny_model

    src = make_tiny_model("llama", tiny_root)  # hidden 64, ffn 128: row-parallel shards of 32 and 64 inputs
    folder = tiny_root / f"tp-{method}"
    if method == "fp8":
        ct_checkpoint(src, folder, "FP8_DYNAMIC")
    elif not (folder / "config.json").exists():
        kind = method.split("_")[0]
        write_quantized_llama(src, folder, kind, bits=4, group_size=32, sym=kind == "gptq", act_order="act" in method)
    tp1, llm1 = generate(str(folder), 1)
    llm1.shutdown()
    tp2, llm2 = generate(str(folder), 2)
    try:
        winner = llm2.engine.parts.selections["quantization"].winner.name
        assert winner == ("compressed-tensors" if method == "fp8" else method.split("_")[0])
    finally:
        llm2.shutdown()
    assert tp2 == tp1


def test_gguf_blocks_split_only_on_block_boundaries() -> None:
    import gguf
    import numpy as np

    from pagedllm.formats.gguf_blocks import GGUFBlocks, Q

    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    blocks = GGUFBlocks(torch.from_numpy(gguf.quants.quantize(w, Q.Q8_0)), Q.Q8_0, (4, 64))
    right = blocks.narrow_cols(32, 32).dequantize()
    assert torch.equal(right, blocks.dequantize()[:, 32:])
    with pytest.raises(ValueError, match="Q8_0 holds 32 weights per block; columns 16..48 of 64"):
        blocks.narrow_cols(16, 32)
    padded = blocks.pad_rows(6).dequantize()
    assert torch.equal(padded[:4], blocks.dequantize()) and not padded[4:].any()


def test_dummy_shards_are_slices_of_the_tp1_weights(tiny_root: Path) -> None:
    """Each rank's dummy shard equals its slice of the tp=1 dummy weights (built in-process, no group)."""
    from pagedllm.engine.builder import build_engine_parts

    # No group is joined here: the build's one collective (world_min of the KV blocks) is the identity.
    model = save_model("qwen2_kv1", tiny_root)
    base = dict(model=model, device="cpu", loader={"name": "dummy"}, kv_cache={"num_blocks": 4})
    full = build_engine_parts(EngineConfig.from_dict(base)).model.state_dict()
    shards = [
        build_engine_parts(
            EngineConfig.from_dict({**base, "parallel": {"tensor_parallel_size": 2}}), tp_rank=rank
        ).model.state_dict()
        for rank in (0, 1)
    ]
    vocab = tp_config("qwen2_kv1").vocab_size
    embed = torch.cat([s["model.embed_tokens.weight"] for s in shards])
    assert torch.equal(embed[:vocab], full["model.embed_tokens.weight"]) and not embed[vocab:].any()
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    q_full, k_full, v_full = full[qkv].split([64, 16, 16])  # 4 q heads and 1 KV head of 16
    for rank, shard in enumerate(shards):
        q, k, v = shard[qkv].split([32, 16, 16])
        assert torch.equal(q, q_full[rank * 32 : (rank + 1) * 32])
        assert torch.equal(k, k_full) and torch.equal(v, v_full)  # the one KV head, replicated
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([s[o] for s in shards], dim=1), full[o])
    gate_up = "model.layers.0.mlp.gate_up_proj.weight"
    gate = torch.cat([s[gate_up][:64] for s in shards])
    assert torch.equal(gate, full[gate_up][:128])
    assert torch.equal(shards[1]["model.norm.weight"], full["model.norm.weight"])


@pytest.mark.slow  # starts a rank-1 process
def test_tp2_dummy_equals_tp1_and_a_dead_rank_fails_the_next_step(tiny_root: Path) -> None:
    model = save_model("llama_kv2", tiny_root)
    tp1, llm1 = generate(model, 1, load_format="dummy")
    llm1.shutdown()
    tp2, llm2 = generate(model, 2, load_format="dummy")
    try:
        assert tp2 == tp1
        assert_dead_rank_fails_the_next_step(llm2)
    finally:
        llm2.shutdown()


@dataclasses.dataclass
class _Cfg:
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128


@pytest.mark.parametrize(
    ("cfg", "tp", "message"),
    [
        (_Cfg(), 3, "does not divide num_attention_heads 4"),
        (_Cfg(num_attention_heads=8, num_key_value_heads=6), 4, "does not divide num_key_value_heads 6"),
        (_Cfg(num_attention_heads=12, num_key_value_heads=4), 6, "is not a multiple of num_key_value_heads 4"),
        (_Cfg(intermediate_size=130), 4, "does not divide intermediate_size 130"),
    ],
)
def test_shapes_that_do_not_split_are_refused(cfg: _Cfg, tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=f"parallel.tensor_parallel_size {tp} {message}"):
        check_tensor_parallel(cfg, tp)
    check_tensor_parallel(cfg, 1)


def test_executor_selection(tiny_root: Path) -> None:
    model = save_model("llama_kv2", tiny_root)
    with pytest.raises(SelectionError, match="uniproc.*runs one rank; parallel.tensor_parallel_size is 2"):
        LLM(model, tensor_parallel_size=2, distributed_executor_backend="uniproc", **ENGINE)
    with pytest.raises(Exception, match="tensor_parallel_size"):
        EngineConfig.from_dict({"parallel": {"tensor_parallel_size": 0}})
    from pagedllm.engine.builder import build_engine

    speculative = EngineConfig.from_dict(
        {"model": model, "speculative": {"method": "ngram"}, "parallel": {"tensor_parallel_size": 2}}
    )
    with pytest.raises(ValueError, match="speculative.method 'ngram' with parallel.tensor_parallel_size 2"):
        build_engine(speculative)  # refused before any process starts
    llm = LLM(model, **ENGINE)
    try:
        # tp=1 keeps the single-process path: the core calls the runner's own method, no executor hop.
        assert llm.engine.parts.selections["executor"].winner.name == "uniproc"
        assert llm.engine.core._execute == llm.engine.parts.runner.execute
    finally:
        llm.shutdown()


# -- async scheduling with tp > 1 (model_runner.py NOTE 2, tp_worker.py NOTE 2) ----------------------------


def _async_case(probe: list[list[int]]) -> tuple[list[dict], list[SamplingParams]]:
    """Eight requests: greedy, seeded random with penalties and logprobs, unseeded random, greedy stopping on
    the 4th token it generates (`probe`: greedy tokens of the same prompts)."""
    import random

    rng = random.Random(9)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(rng.randrange(20, 40))]} for _ in range(8)]
    seeded = dict(temperature=0.9, top_k=50, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2)
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, seed=1, ignore_eos=True, **seeded),
        SamplingParams(max_tokens=24, seed=2, ignore_eos=True, **seeded),
        SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True),  # unseeded: the default generator
        SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[probe[6][3]]),
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[probe[7][3]]),
    ]
    return prompts, params


# Chunked prefill (16-token budget) and a KV cache too small for every request at once (preemption).
# admission_headroom_tokens=0: vLLM's admission rule, so the pool's pressure preempts (the path under test)
TIGHT = dict(device="cpu", block_size=4, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=16,
             enable_prefix_caching=False, admission_headroom_tokens=0)
UNSEEDED = (4, 5)


def _tight_runs(model: str, requests: list[tuple[list[dict], Any, int]], **kwargs: Any) -> list[Any]:
    """One engine, one generate per (prompts, params, seed); returns the outputs of each."""
    llm = LLM(model, **TIGHT, **kwargs)
    try:
        results = []
        for prompts, params, seed in requests:
            torch.manual_seed(seed)  # rank 0's default generator: the unseeded rows' noise
            results.append(llm.generate(prompts, params, use_tqdm=False))
            assert llm.engine.kv_cache_usage == 0.0
        return results
    finally:
        llm.shutdown()


def _ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.slow  # starts a rank-1 process
def test_tp2_async_scheduling_equals_tp1(tiny_root: Path) -> None:
    """tp=2 pipelined: the tokens of tp=1 synchronous (greedy, seeded, stop tokens) and of tp=1 pipelined with
    the same default-generator seed (unseeded rows too), through chunked prefill and preemption.

    The unseeded rows check that every rank feeds the model rank 0's samples: rank 1 is a fresh process whose
    default generator is not rank 0's (seeded below), so a rank 1 that fed its own samples would give its half
    of the heads other tokens than rank 0's, and the logits would leave tp=1's (seen: with rank 1 sampling
    for itself and no broadcast, this test fails on the first assert)."""
    model = save_model("llama_kv2", tiny_root)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    probe_prompts, _ = _async_case([[0] * 4] * 8)
    llm = LLM(model, **TIGHT, async_scheduling=False)
    try:
        probe = _ids(llm.generate(probe_prompts, greedy, use_tqdm=False))
        prompts, params = _async_case(probe)
        torch.manual_seed(7)
        sync1 = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    async1, other_seed = _tight_runs(model, [(prompts, params, 7), (prompts, params, 8)], async_scheduling=True)
    llm2 = LLM(model, **TIGHT, tensor_parallel_size=2, async_scheduling=True)
    try:
        assert llm2.engine.core.async_scheduling
        torch.manual_seed(7)
        async2 = llm2.generate(prompts, params, use_tqdm=False)
        stats2 = llm2.engine.get_stats()
        assert llm2.engine.kv_cache_usage == 0.0
        # A dead rank still fails the next step with its name (pipelined steps get no reply from it).
        assert_dead_rank_fails_the_next_step(llm2)
    finally:
        llm2.shutdown()

    sync1_ids, async1_ids, other_ids, async2_ids = map(_ids, (sync1, async1, other_seed, async2))
    assert async2_ids == async1_ids
    assert [t for i, t in enumerate(async2_ids) if i not in UNSEEDED] == \
        [t for i, t in enumerate(sync1_ids) if i not in UNSEEDED]
    # The check above can see a rank's generator: another seed draws other unseeded tokens.
    assert all(other_ids[i] != async1_ids[i] for i in UNSEEDED)
    assert [len(t) for t in async2_ids[:6]] == [p.max_tokens for p in params[:6]]
    # Stopped on the stop token's first appearance, nothing leaked after it.
    assert [len(t) for t in async2_ids[6:]] == [probe[i].index(probe[i][3]) + 1 for i in (6, 7)]
    assert [o.outputs[0].finish_reason for o in async2] == [o.outputs[0].finish_reason for o in sync1]
    assert stats2.num_preemptions > 0
    for i in (2, 3):  # logprobs come from rank 0 alone
        got, ref = async2[i].outputs[0].logprobs, sync1[i].outputs[0].logprobs
        assert [sorted(x) for x in got] == [sorted(x) for x in ref]


# -- leaving the group (cuda_graphs.py NOTE 5) ------------------------------------------------------------

_EXIT_SCRIPT = """
import sys, time
from pagedllm import LLM, SamplingParams

def main():
    llm = LLM(sys.argv[1], device="cpu", block_size=4, tensor_parallel_size=2, async_scheduling=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    procs = llm.engine.parts.executor._procs
    t0 = time.perf_counter()
    llm.shutdown()
    print(f"shutdown_s={time.perf_counter() - t0:.2f} exitcodes={[p.exitcode for p in procs]}", flush=True)

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow  # starts a process that starts a rank-1 process
def test_tp2_engine_shuts_down_and_exits_cleanly(tiny_root: Path, tmp_path: Path) -> None:
    """shutdown() leaves the group on both ranks within the teardown timeout (no 'did not finish' warning),
    the worker exits with 0, and so does the process afterwards (no abort at interpreter exit)."""
    import subprocess
    import sys

    model = save_model("llama_kv2", tiny_root)
    script = tmp_path / "tp_exit.py"
    script.write_text(_EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script), model], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "did not finish" not in done.stderr and "terminate called" not in done.stderr, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("shutdown_s="))
    seconds, codes = line.split()
    assert float(seconds.split("=")[1]) < 10.0  # the teardown's own timeout
    assert codes == "exitcodes=[0]"


class _RecordingRunner:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def release_cuda_graphs(self) -> None:
        self.log.append("graphs released")


def test_every_rank_releases_cuda_graphs_before_leaving_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL waits for every graph holding its collectives before a communicator goes (cuda_graphs.py NOTE 5):
    rank 0's executor and the remote ranks' worker release the runner's graphs first."""
    from pagedllm.executor import tp_worker
    from pagedllm.plugins.executors.multiproc import executor as multiproc_executor
    from pagedllm.protocols.executor import ExecutorContext

    log: list[str] = []
    for module in (tp_worker, multiproc_executor):
        monkeypatch.setattr(module, "destroy_tensor_parallel", lambda **_: log.append("left group"))
    config = EngineConfig.from_dict({"parallel": {"tensor_parallel_size": 2}})

    executor = multiproc_executor.MultiprocExecutor(ExecutorContext(config))
    executor._runner = _RecordingRunner(log)
    executor.shutdown()
    worker = tp_worker.TPWorker(config.model_dump(), 1, "127.0.0.1", 1)
    worker.runner = _RecordingRunner(log)
    worker.close()
    assert log == ["graphs released", "left group"] * 2
