"""Where a cold start's seconds go (issue 5: start-up to the first request <= 30 s): bench_suite.py's engine
(Llama-3.1-8B shape, dummy weights, the triton backend) built under cProfile, with the builder's phases.

    TRITON_CACHE_DIR=/tmp/tc_cold python examples/gpu/startup_profile.py > $OUT/startup_profile.txt

Run it on a fresh machine, before anything else compiled (a private TRITON_CACHE_DIR keeps the default cache
cold for a benchmark after it). Prints the phases, the Triton compiles (calls and seconds) and the functions
with the most cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_suite import start_engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--plugins", default=None, metavar="JSON")
    args = ap.parse_args()
    bench = argparse.Namespace(model_dir="/tmp/llama31_8b_dummy_startup", backend="triton", max_num_seqs=1024,
                               max_num_batched_tokens=16384, async_scheduling="auto", plugins=args.plugins)
    t0 = time.perf_counter()
    import torch  # noqa: F401 - the CUDA context is made before the timed build, as in bench_suite.py

    torch.cuda.init()
    print(f"torch import + CUDA init {time.perf_counter() - t0:.1f} s", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    llm, info = start_engine(bench, None, 0.9)
    profile.disable()
    print(f"startup {info['startup_s']} s")
    print("\n".join(line for line in info["selections"].splitlines() if "start-up" in line))
    stats = pstats.Stats(profile, stream=(buf := io.StringIO()))
    stats.sort_stats("cumulative").print_stats(args.top)
    # Triton's compiles: calls and seconds of its compile entry point (the JIT calls it once per binary).
    for (path, _, name), (_, calls, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if name == "compile" and "triton" in path and path.endswith("compiler.py"):
            print(f"triton compile: {calls} binaries, {cum:.1f} s")
        if name in ("_build", "make_launcher", "compile_module_from_src") and "triton" in path:
            print(f"triton {name}: {calls} calls, {cum:.1f} s")
    print(buf.getvalue())
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
