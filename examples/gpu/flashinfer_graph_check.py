"""FlashInfer decode inside the engine's CUDA graphs, on the GPU (issue 8 item 1; H200, 3-4 min warm, ~6 cold).

    python -c "import flashinfer" || pip install -q --no-index --no-deps .gpuwhl/fi068/*.whl
    FLASHINFER_WORKSPACE_BASE=<kept dir> python examples/gpu/flashinfer_graph_check.py --out $OUT/fi_graph.json
        [--stages k,e,w] [--w3-tokens 256] [--w3-model 8b|small]

The graph path (flashinfer/backend.py NOTE 3, cuda_graphs.py NOTE 6) re-plans FlashInfer's graph-mode decode
wrappers before every replay. FlashInfer JIT-compiles each kernel variant on first use (~20-90 s on a fresh
machine, cached under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer, default ~): this script needs the bf16 head-128
decode module (the graph wrapper's and the eager one are the same module) and the FA3 prefill module -- the
ones attn_backends_check.py's stages a/b build, so a warm cache from that run makes this one JIT-free.

Stages, each written to the JSON as soon as it ends:
  k  attention-level: one flashinfer layer (32 q / 8 KV heads, head 128, page 16, bf16) captured by the
     runner's DecodeGraphs at sizes 1..32, replayed for random decode steps (1..32 requests, contexts up to
     2048, random pages, padded rows): relative L2 vs the torch backend and vs eager flashinfer on the same
     inputs (expect ~2e-3 and ~0, bar < 1e-2); host microseconds of one `DecodeGraphs.run` (load + re-plan +
     replay launch) for flashinfer and triton
  e  engine greedy tokens on a random Llama (head 128, 8 layers, transformers init): flashinfer with graphs
     == flashinfer eager (enforce_eager) == triton with graphs, 8 prompts x 32 tokens and a padded run
     (5 prompts of 32/32/20/9/3 tokens: decode batches 5, 3, 2, 1 on graphs of 8, 4, 2, 1); the number of
     graph replays is recorded so a silent eager fallback cannot pass
  w  W3-style single stream (128 in, --w3-tokens out, median of 3, engine stepped by hand): ms/token for
     flashinfer and triton, graphs vs eager, on the Llama-3.1-8B shape with dummy weights (--w3-model small:
     the stage-e model)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from h200_check import LLAMA_8B_CONFIG, make_model_dir  # noqa: E402
from tp_check import single_stream  # noqa: E402  (bench_suite's W3: the engine stepped by hand)

T0 = time.time()
RESULTS: dict[str, Any] = {"stages": {}}
OUT = "fi_graph.json"
HEADS, KV_HEADS, HEAD, PAGE = 32, 8, 128, 16
# A small Llama with head size 128 (the JIT variant of stages a/b of attn_backends_check.py).
SMALL_128: dict[str, Any] = {
    **LLAMA_8B_CONFIG, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 32000,
    "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
    "initializer_range": 0.05,  # wide enough that greedy argmax is decided by the model, not by rounding
}


def put(key: str, value: Any) -> None:
    RESULTS["stages"][key] = value
    RESULTS["elapsed_s"] = round(time.time() - T0, 1)
    print(f"[{time.time() - T0:6.1f}s] {key}: {json.dumps(value, default=str)[:900]}", flush=True)
    with open(OUT, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def fail(key: str, exc: BaseException) -> None:
    put(key, {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-3000:]})


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def first_diff(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (len when equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ------------------------------------------------------------------------------ k: attention-level graphs
def stage_kernel() -> None:
    from pagedllm.plugins.attention.flashinfer.backend import FlashInferBackend
    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
    from pagedllm.plugins.attention.triton.backend import TritonBackend
    from pagedllm.protocols.attention import AttentionLayerConfig
    from pagedllm.worker.cuda_graphs import DecodeGraphs, StepBuffers
    from pagedllm.worker.input_prep import plan_inputs, prepare_inputs

    dev = torch.device("cuda")
    max_reqs, max_ctx = 32, 2048
    max_blocks = max_ctx // PAGE + 1
    num_blocks = 1 + max_reqs * max_blocks + 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2, num_blocks, PAGE, KV_HEADS, HEAD, generator=gen, device=dev).to(torch.bfloat16)
    layer = AttentionLayerConfig(HEADS, HEAD, KV_HEADS, HEAD**-0.5)
    q, k, v = (torch.zeros(2 * max_reqs, h, HEAD, dtype=torch.bfloat16, device=dev)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    sizes = [1, 2, 4, 8, 16, 32]
    rng = torch.Generator().manual_seed(1)

    def graphs_for(backend: Any) -> DecodeGraphs:
        impl = backend.make_impl(layer)

        def model(ids: torch.Tensor, pos: torch.Tensor, md: Any, caches: list[torch.Tensor]) -> torch.Tensor:
            n = ids.shape[0]
            return impl.forward(q[:n], k[:n], v[:n], caches[0], md)

        buffers = StepBuffers(2 * max_reqs, max_reqs, max_blocks, dev)
        graphs = DecodeGraphs(model, backend, [cache], buffers)
        t = time.perf_counter()
        graphs.capture(sizes, [PAGE])
        print(f"  {backend.name}: captured {graphs.sizes} in {time.perf_counter() - t:.1f} s", flush=True)
        return graphs

    def step(b: int) -> tuple[list[int], list[list[int]]]:
        lens = torch.randint(1, max_ctx + 1, (b,), generator=rng).tolist()
        perm = (torch.randperm(num_blocks - 1, generator=rng) + 1).tolist()
        blocks, used = [], 0
        for n in lens:
            blocks.append(perm[used : used + -(-n // PAGE)])
            used += len(blocks[-1])
        return lens, blocks

    def host(lens: list[int], blocks: list[list[int]]) -> Any:
        return plan_inputs([[0] * n for n in lens], [n - 1 for n in lens], [1] * len(lens), blocks, PAGE, len(lens))

    with torch.inference_mode():
        fi = graphs_for(FlashInferBackend)
        rows = []
        for b in (1, 3, 8, 13, 32, 5, 1, 32):
            lens, blocks = step(b)
            for x in (q, k, v):
                x.normal_(generator=gen)
            before = cache.clone()
            got = fi.run(host(lens, blocks))
            assert got is not None, f"no graph replayed a decode step of {b}"
            out = got[1][:b].clone()
            fresh = prepare_inputs([[0] * n for n in lens], [n - 1 for n in lens], [1] * b, blocks, PAGE, dev,
                                   b).attn
            ref = TorchSDPABackend.make_impl(layer).forward(q[:b], k[:b], v[:b], before.clone(),
                                                            TorchSDPABackend.build_metadata(fresh))
            eager = FlashInferBackend.make_impl(layer).forward(q[:b], k[:b], v[:b], before,
                                                               FlashInferBackend.build_metadata(fresh))
            torch.cuda.synchronize()
            rows.append({"reqs": b, "graph": [s for s in sizes if s >= b][0], "max_ctx": max(lens),
                         "rel_vs_torch": round(rel(out, ref), 5), "rel_vs_eager_flashinfer": round(rel(out, eager), 6),
                         "nan": int(torch.isnan(out).sum())})
        ok = all(r["rel_vs_torch"] < 1e-2 and r["rel_vs_eager_flashinfer"] < 1e-2 and not r["nan"] for r in rows)
        put("k_graph_replay_vs_torch", {"ok": ok, "rows": rows})

        host_us: dict[str, Any] = {}
        tr = graphs_for(TritonBackend)
        for name, graphs in (("flashinfer", fi), ("triton", tr)):
            for b in (1, 32):
                h = host(*step(b))
                graphs.run(h)
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(50):
                    graphs.run(h)
                host_us[f"{name}_b{b}"] = round((time.perf_counter() - t) / 50 * 1e6, 1)
                torch.cuda.synchronize()
        put("k_host_us_per_graph_run", host_us)
        fi.release()
        tr.release()


# ------------------------------------------------------------------------------ e: engine greedy tokens
class Engine:
    """An LLM on the GPU, counting the decode steps that really replayed a captured graph."""

    def __init__(self, path: str, backend: str, eager: bool, *, dummy: bool = False, max_len: int = 2048) -> None:
        from pagedllm import LLM
        from pagedllm.config import EngineConfig

        cfg = EngineConfig.from_dict({
            "model": path, "dtype": "bfloat16", "device": "cuda", "seed": 0, "enforce_eager": eager,
            "max_model_len": max_len, "attention": {"backend": backend},
            "kv_cache": {"num_blocks": 4096, "block_size": PAGE},
            "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 512},
            **({"loader": {"name": "dummy"}} if dummy else {}),
        })
        t = time.perf_counter()
        self.llm = LLM(config=cfg)
        self.startup_s = round(time.perf_counter() - t, 1)
        runner = self.llm.engine.parts.runner
        self.graph_sizes = runner.graph_sizes
        self.replays = 0
        graphs = getattr(runner, "_graphs", None)
        if graphs is not None:
            run = graphs.run

            def counted(*args: Any, **kw: Any) -> Any:
                got = run(*args, **kw)
                self.replays += got is not None
                return got

            graphs.run = counted

    def close(self) -> None:
        self.llm.shutdown()
        del self.llm
        gc.collect()
        torch.cuda.empty_cache()


def stage_engine(root: str) -> str:
    import transformers

    from pagedllm import SamplingParams

    path = make_model_dir(SMALL_128, root, "small_llama_h128")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in SMALL_128.items()
                                                                   if k != "architectures"}))
    hf.to(torch.bfloat16).save_pretrained(path)  # type: ignore[arg-type]  # transformers' typed `to` wrapper
    del hf
    g = torch.Generator().manual_seed(2)
    lens = (5, 17, 64, 100, 230, 333, 512, 700)
    prompts = [{"prompt_token_ids": torch.randint(10, 31990, (n,), generator=g).tolist()} for n in lens]
    runs = {
        "8x32": (prompts, [32] * 8),
        "padded": (prompts[:5], [32, 32, 20, 9, 3]),
    }
    configs = (("flashinfer", False), ("flashinfer", True), ("triton", False))
    tokens: dict[str, Any] = {}
    info: dict[str, Any] = {}
    for backend, eager in configs:
        key = f"{backend}_{'eager' if eager else 'graphs'}"
        try:
            eng = Engine(path, backend, eager)
            info[key] = {"startup_s": eng.startup_s, "graph_sizes": eng.graph_sizes}
            for run_name, (ps, max_tokens) in runs.items():
                params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False)
                          for m in max_tokens]
                before = eng.replays
                outs = eng.llm.generate(ps, params, use_tqdm=False)
                tokens[f"{key}/{run_name}"] = [list(o.outputs[0].token_ids) for o in outs]
                info[key][f"{run_name}_graph_replays"] = eng.replays - before
            eng.close()
            del eng
        except Exception as exc:
            info[key] = f"{type(exc).__name__}: {exc}"[:600]
            traceback.print_exc()
    rows: dict[str, Any] = {}
    for run_name in runs:
        ref = tokens.get(f"flashinfer_graphs/{run_name}")
        for other in ("flashinfer_eager", "triton_graphs"):
            val = tokens.get(f"{other}/{run_name}")
            if ref is None or val is None:
                rows[f"flashinfer_graphs_vs_{other}/{run_name}"] = "missing"
                continue
            rows[f"flashinfer_graphs_vs_{other}/{run_name}"] = (
                True if ref == val else [first_diff(a, b) for a, b in zip(ref, val)])
    put("e_engine_greedy", {"equal": rows, "engines": info})
    return path


# ------------------------------------------------------------------------------ w: W3 single stream
def stage_w3(root: str, small_path: str | None, out_len: int, model: str) -> None:
    if model == "small" and small_path is not None:
        path, dummy = small_path, False
    else:
        path, dummy = make_model_dir(LLAMA_8B_CONFIG, root, "llama8b_dummy"), True
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 31990, (128,), generator=g).tolist() for _ in range(4)]
    rows: dict[str, Any] = {"model": "llama-3.1-8b shape, dummy weights" if dummy else "stage-e model",
                            "out_tokens": out_len}
    for backend in ("flashinfer", "triton"):
        for eager in (False, True):
            key = f"{backend}_{'eager' if eager else 'graphs'}"
            try:
                eng = Engine(path, backend, eager, dummy=dummy, max_len=1024)
                single_stream(eng.llm.engine, prompts[0], 16, f"{key}-warm")
                reps = [single_stream(eng.llm.engine, prompts[i + 1], out_len, f"{key}-{i}") for i in range(3)]
                rows[key] = {"ms_per_token": round(statistics.median(reps), 3), "reps": [round(r, 3) for r in reps],
                             "graph_replays": eng.replays, "startup_s": eng.startup_s}
                eng.close()
                del eng
            except Exception as exc:
                rows[key] = f"{type(exc).__name__}: {exc}"[:600]
                traceback.print_exc()
            print(f"  {key}: {rows[key]}", flush=True)
    for backend in ("flashinfer", "triton"):
        a, b = rows.get(f"{backend}_graphs"), rows.get(f"{backend}_eager")
        if isinstance(a, dict) and isinstance(b, dict):
            rows[f"{backend}_eager_over_graphs"] = round(b["ms_per_token"] / a["ms_per_token"], 2)
    put("w_w3_ms_per_token", rows)


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--stages", default="k,e,w")
    ap.add_argument("--w3-tokens", type=int, default=256)
    ap.add_argument("--w3-model", choices=("8b", "small"), default="8b")
    args = ap.parse_args()
    OUT = args.out
    stages = args.stages.split(",")
    try:
        import flashinfer

        fi_version = flashinfer.__version__
    except Exception as exc:  # recorded, and every stage will say why it failed
        fi_version = f"not importable: {exc}"
    put("env", {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": fi_version,
                "FLASHINFER_WORKSPACE_BASE": os.environ.get("FLASHINFER_WORKSPACE_BASE")})
    if "k" in stages:
        try:
            stage_kernel()
        except Exception as exc:
            fail("k_error", exc)
    with tempfile.TemporaryDirectory() as root:
        small = None
        if "e" in stages:
            try:
                small = stage_engine(root)
            except Exception as exc:
                fail("e_error", exc)
        if "w" in stages:
            try:
                stage_w3(root, small, args.w3_tokens, args.w3_model)
            except Exception as exc:
                fail("w_error", exc)
    print("\n" + "=" * 100)
    for key, val in RESULTS["stages"].items():
        print(f"{key}: {json.dumps(val, default=str)[:1500]}")
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
