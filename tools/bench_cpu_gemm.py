"""Per-kernel CPU microbenchmark of a GGUF matrix's large products (issue #30): ms per call, min of N repeats.

    python tools/bench_cpu_gemm.py [--threads 1,2] [--rows 16,32,64,128,256,512] [--repeats 30] [--type Q4_1]
                                   [--shapes 576x576,192x576,1536x576,576x1536,49152x576] [--tiles 6x2,4x3]
                                   [--cold 30] [--no-c]

Per shape (N x K: output columns x inputs, SmolLM2's matrices by default) and row count M, each kernel on the
same random blocks:

    bf16     the bf16 copy in bf16_gemm.c's panels (batch_gemm.Bf16Matrix: the default batch path on bf16 units)
    onednn   the bf16 copy packed for oneDNN (Bf16Matrix(own_kernel=False): the batch path before bf16_gemm.c)
    int8     int8_gemm.c (Int8Matrix: int8 activations per 32, vpdpbusd); one column per --tiles entry
    int8x2   int8_gemm.c with 16-bit activations as two int8 halves (its NOTE 4: twice the vpdpbusd)
    c        gguf_cpu.c's gguf_matmul (the decode kernel, int16 activations) at the same M

`--cold 30` cycles each kernel through 30 copies of the matrix (a model's layers), so the weights arrive from
memory as they do in the engine; without it the same matrix stays in cache. The kernels run interleaved, round after round (A B C A B C ...), so a neighbour's load lands on all of them;
the load average is printed at the start and the end. The last columns are bf16's time over each other column's
but c's (onednn, then the int8 builds).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from gguf import GGMLQuantizationType

from pagedllm.formats.gguf_blocks import random_blocks
from pagedllm.plugins.quantization.gguf.batch_gemm import Bf16Matrix
from pagedllm.plugins.quantization.gguf.int8_gemm import Int8Matrix, int8_library
from pagedllm.plugins.quantization.gguf.kernels import NativeKernel
from pagedllm.plugins.quantization.gguf.native import native_library


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _time(fns: list[Callable[[], object]], inner: int) -> float:
    """Seconds for `inner` passes over `fns` (one call per matrix copy), per pass."""
    t = time.perf_counter()
    for _ in range(inner):
        for fn in fns:
            fn()
    return (time.perf_counter() - t) / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="16,32,64,128,256,512")
    ap.add_argument("--shapes", default="576x576,192x576,1536x576,576x1536,49152x576")
    ap.add_argument("--type", default="Q4_1")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tiles", default="", help="extra int8 builds MRxNR[xPREFETCHxCHUNKED] (rows x 16-column "
                    "panels; int8_gemm.c NOTE 5's switches, 0 or 1)")
    ap.add_argument("--no-c", action="store_true", help="skip gguf_cpu.c's kernel (slow at many rows)")
    ap.add_argument("--cold", type=int, default=0, help="cycle through this many copies of each matrix (e.g. "
                    "30, a model's layers), so the weights come from memory as in the engine, not from cache")
    args = ap.parse_args()
    ggml_type = GGMLQuantizationType[args.type]
    native = native_library()
    tiles: list[tuple[int, ...] | None] = [None]
    tiles += [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t]  # type: ignore[misc]
    libs = {t: int8_library(t) for t in tiles}
    if any(v is None for v in libs.values()):
        raise SystemExit("int8_gemm.c unavailable on this CPU / build")
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} type {args.type} loadavg {_loadavg()} "
          f"cpus {os.cpu_count()} int8 tile {libs[None].tile if libs[None] else '?'}")
    names = ["bf16", "onednn"] + [f"int8{'' if t is None else '_' + 'x'.join(map(str, t))}" for t in tiles] + ["int8x2"]
    names += [] if args.no_c else ["c"]
    print(f"{'thr':>3} {'N':>6} {'K':>5} {'M':>4} " + " ".join(f"{n:>10}" for n in names) + "  bf16/onednn, bf16/int8")
    gen = torch.Generator().manual_seed(0)
    copies = max(1, args.cold)
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            sets: list[list[Any]] = []  # per copy: the kernels' matrices, then the blocks for gguf_cpu.c
            for _ in range(copies):
                blocks = random_blocks(ggml_type, n, k, gen, torch.device("cpu")).data.contiguous()
                dense = NativeKernel(blocks, int(ggml_type), (n, k), native).dequantize()
                mats: list[Any] = [Bf16Matrix(dense), Bf16Matrix(dense, own_kernel=False)]
                mats += [Int8Matrix(libs[t], int(ggml_type), blocks, n, k) for t in tiles]  # type: ignore[arg-type]
                mats.append(Int8Matrix(libs[None], int(ggml_type), blocks, n, k, precise=True))  # type: ignore[arg-type]
                sets.append([*mats, blocks])
            for m in [int(v) for v in args.rows.split(",")]:
                x = torch.randn(m, k)
                y = torch.empty(m, n)
                fns: list[list[Callable[[], object]]] = [
                    [functools.partial(c[i], x) for c in sets] for i in range(len(sets[0]) - 1)
                ]
                if not args.no_c:
                    assert native is not None
                    fns.append([functools.partial(native.matmul, int(ggml_type), c[-1], n, k, x, y) for c in sets])
                inner = max(1, int(2e8 // (2 * m * n * k * copies)))
                best = [float("inf")] * len(fns)
                for f in fns:
                    _time(f, 1)
                for _ in range(args.repeats):
                    for i, f in enumerate(fns):
                        best[i] = min(best[i], _time(f, inner) / copies)
                ratio = " ".join(f"{best[0] / b:.2f}" for b in best[1 : 3 + len(tiles)])
                times = " ".join(f"{b * 1e3:>10.3f}" for b in best)
                print(f"{threads:>3} {n:>6} {k:>5} {m:>4} {times}  {ratio}", flush=True)
    print(f"# end loadavg {_loadavg()}")


if __name__ == "__main__":
    main()
