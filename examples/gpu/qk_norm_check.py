"""The fused per-head q/k norm + RoPE (layers/qk_norm.py) against the three kernels it replaces, on a GPU.

Run on the GPU machine: `python examples/gpu/qk_norm_check.py` (the Qwen3-4B attention shape: 32 q heads,
8 kv heads, head 128, bf16; `--tokens 16384,1`). For each token count it builds one qkv buffer and checks that
the fused launch gives, bit for bit, what rms_norm on q, rms_norm on k and rotary_embedding give one after
another (and Gemma's (1 + w) form likewise), then times both ways with CUDA graphs of `--reps` calls each,
old and new interleaved so clock drift shows in both. Prints one JSON line per token count.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.qk_norm import qk_norm_rope
from pagedllm.layers.rotary import RotaryEmbedding


def _graph(fn: Callable[[], object], reps: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def _time(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def check(tokens: int, heads: int, kv_heads: int, head: int, gemma: bool, reps: int, rounds: int) -> dict[str, object]:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(tokens)
    norm_cls = GemmaRMSNorm if gemma else RMSNorm
    q_norm, k_norm = norm_cls(head, 1e-6, dtype).to(dev), norm_cls(head, 1e-6, dtype).to(dev)
    with torch.no_grad():
        for norm in (q_norm, k_norm):
            norm.weight.copy_(torch.randn(head, generator=gen, device=dev) * 0.5 + (0.0 if gemma else 1.0))
    rope = RotaryEmbedding(head, head, 40960, 1e6).to(dev)
    q_size, kv_size = heads * head, kv_heads * head
    source = (torch.randn(tokens, q_size + 2 * kv_size, generator=gen, device=dev) * 3).to(dtype)
    positions = torch.randint(0, 40960, (tokens,), generator=gen, device=dev)

    def old(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = q_norm(qkv[:, :q_size].reshape(tokens, heads, head)).reshape(tokens, q_size)
        k = k_norm(qkv[:, q_size : q_size + kv_size].reshape(tokens, kv_heads, head)).reshape(tokens, kv_size)
        q, k = rope(positions, q, k)
        return q, k

    def new(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
        return qk_norm_rope(positions, q, k, q_norm, k_norm, rope, head)

    old_q, old_k = old(source.clone())
    new_q, new_k = new(source.clone())
    differ = int((old_q != new_q).sum() + (old_k != new_k).sum())
    max_diff = max(float((old_q.float() - new_q.float()).abs().max()), float((old_k.float() - new_k.float()).abs().max()))

    buf_old, buf_new = source.clone(), source.clone()  # the timed calls normalise their buffer again each rep
    g_old, g_new = _graph(lambda: old(buf_old), reps), _graph(lambda: new(buf_new), reps)
    t_old, t_new = [], []
    for _ in range(rounds):
        t_old.append(_time(g_old) / reps * 1000)
        t_new.append(_time(g_new) / reps * 1000)
    return {
        "tokens": tokens, "form": "gemma" if gemma else "llama", "elements": old_q.numel() + old_k.numel(),
        "differ": differ, "max_abs_diff": max_diff,
        "old_us": round(min(t_old), 2), "new_us": round(min(t_new), 2),
        "speedup": round(min(t_old) / min(t_new), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,1")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20, help="calls per timed CUDA graph")
    ap.add_argument("--rounds", type=int, default=5, help="old/new graph replays, interleaved; the min is shown")
    args = ap.parse_args()
    ok = True
    for tokens in (int(t) for t in args.tokens.split(",")):
        for gemma in (False, True):
            res = check(tokens, args.heads, args.kv_heads, args.head, gemma, args.reps, args.rounds)
            print(json.dumps(res), flush=True)
            ok = ok and res["differ"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
