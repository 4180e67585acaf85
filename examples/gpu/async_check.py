"""Async scheduling on the GPU gives the tokens synchronous steps give (CUDA graphs, device-side input fill).

    python examples/gpu/async_check.py      # ~30 s on the H200; prints ASYNC_CHECK_JSON={...}; exit 1 on a mismatch

A ~100M Llama (h200_check.SMALL_LLAMA, dummy bf16 weights, same seed in both engines), 48 requests with mixed
prompt lengths, chunked prefill (budget 256), max_tokens 1..64, stop tokens, and seeded sampling with penalties.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from h200_check import SMALL_LLAMA, free_engine, make_model_dir  # noqa: E402


def main() -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.config import EngineConfig

    path = make_model_dir(SMALL_LLAMA, tempfile.mkdtemp(), "small_llama")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(rng.randrange(5, 300))]}
               for _ in range(48)]
    params = []
    for i in range(48):
        if i % 3 == 2:
            params.append(SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=1 + i, ignore_eos=True,
                                         repetition_penalty=1.2, presence_penalty=0.3))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + (i * 7) % 64, ignore_eos=True,
                                         stop_token_ids=[rng.randrange(100, 30000)] if i % 4 == 0 else None))
    result: dict = {}
    outs = {}
    for mode in (False, True):
        cfg = EngineConfig.from_dict({
            "model": path, "dtype": "bfloat16", "device": "cuda", "seed": 0, "loader": {"name": "dummy"},
            "kv_cache": {"gpu_memory_utilization": 0.3},
            "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 256, "async_scheduling": mode},
        })
        llm = LLM(config=cfg)
        assert llm.engine.core.async_scheduling == mode
        llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)
        t0 = time.perf_counter()
        got = llm.generate(prompts, params, use_tqdm=False)
        result[f"async={mode}_s"] = round(time.perf_counter() - t0, 3)
        outs[mode] = [o.outputs[0].token_ids for o in got]
        result[f"async={mode}_kv_usage_after"] = llm.engine.kv_cache_usage
        free_engine(llm)  # shutdown; the names below must go too before the next engine sizes its cache
        del llm, got
        gc.collect()
        torch.cuda.empty_cache()
    same = [a == b for a, b in zip(outs[False], outs[True], strict=True)]
    result["identical_requests"] = f"{sum(same)}/{len(same)}"
    result["lengths_ok"] = all(len(t) <= p.max_tokens for t, p in zip(outs[True], params, strict=True))
    ok = all(same) and result["lengths_ok"] and result["async=True_kv_usage_after"] == 0.0
    result["pass"] = ok
    if not ok:
        result["first_mismatch"] = next(
            (i, outs[False][i][:12], outs[True][i][:12]) for i, s in enumerate(same) if not s) if not all(same) else None
    print("ASYNC_CHECK_JSON=" + json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
