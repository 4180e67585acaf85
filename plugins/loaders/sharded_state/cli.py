"""`pagedllm save-sharded-state MODEL OUTPUT --tensor-parallel-size N`: flags only (no torch here)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "save-sharded-state", help="save a model's tensor-parallel shards, one set of files per rank",
        description="Builds each rank's model from MODEL in turn and writes its weights to OUTPUT as "
        "model-rank-R-part-P.safetensors; `pagedllm serve OUTPUT` (same --tensor-parallel-size) then loads "
        "each rank's own files without slicing.",
    )
    p.add_argument("model", help="a Hugging Face model folder (dense weights)")
    p.add_argument("output", help="folder to write (created if missing)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-file-size", type=int, default=5 * 2**30, help="bytes per file at most")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pagedllm.plugins.loaders.sharded_state.saver import save_sharded_state

    config = {"model": args.model, "dtype": args.dtype,
              "parallel": {"tensor_parallel_size": args.tensor_parallel_size}}
    try:
        files = save_sharded_state(config, args.output, args.max_file_size)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedllm save-sharded-state: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} file(s) for {args.tensor_parallel_size} rank(s) to {args.output}")
    return 0
