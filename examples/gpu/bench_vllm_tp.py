"""vLLM with tensor parallelism on the anchor's workloads: ../shared/anchors/vllm/bench_vllm.py (copied to
anchors/vllm/ in the checkout, git-ignored, carried to the GPU machine with its wheels) with one argument added,
tensor_parallel_size=$VLLM_TP (default 2). Same prompts, timing and JSON; arguments go to bench_vllm.py.

    VLLM_TP=2 PYTHONPATH=/tmp/site python examples/gpu/bench_vllm_tp.py --workloads W1,W2,W3 --scale 0.2
"""

import functools
import os
import sys

ANCHOR = os.environ.get("VLLM_ANCHOR_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "anchors", "vllm"))
sys.path.insert(0, os.path.abspath(ANCHOR))
import vllm  # noqa: E402

vllm.LLM = functools.partial(vllm.LLM, tensor_parallel_size=int(os.environ.get("VLLM_TP", "2")))
import bench_vllm  # noqa: E402

if __name__ == "__main__":  # vLLM's workers are spawned and import this module again: run only in the parent
    bench_vllm.main()
