"""The engine under test and the facts about it that the baselines and the report need."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.plugins.commands.bench.workloads import Workload


@dataclass
class BenchTarget:
    """Our engine, built once per benchmark run.

    `model_ref` is the resolved model (a .gguf file or a folder), `loader` the loader plugin that read it:
    the baselines load the same reference so every engine decodes with the same weights (except `dummy`,
    where both sides draw their own random weights).
    """

    llm: Any
    model_ref: str
    loader: str
    hf_config: Any
    tokenizer: Any | None
    max_model_len: int
    seed: int
    build_seconds: float

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchTarget:
        from pagedllm.api.cli import engine_config_from_args
        from pagedllm.api.engine import LLM

        config = engine_config_from_args(args)
        t0 = time.perf_counter()
        llm = LLM(config=config)
        build_seconds = time.perf_counter() - t0
        info = llm.engine_info()
        return cls(
            llm=llm,
            model_ref=info.model_ref,
            loader=info.components["loader"],
            hf_config=info.hf_config,
            tokenizer=info.tokenizer,
            max_model_len=info.max_model_len,
            seed=config.seed,
            build_seconds=build_seconds,
        )

    @property
    def gguf_path(self) -> str | None:
        """The GGUF file llama.cpp can read, or None when the model is not one."""
        return self.model_ref if self.loader == "gguf" else None

    def weights(self) -> str:
        """Which weights our engine ran, in words for the report (a baseline's row says its own)."""
        quant = self.llm.engine_info().components.get("quantization", "none")
        return f"{self.model_ref} ({self.loader} loader, quantization {quant})"

    def engine_summary(self) -> dict[str, Any]:
        """Engine settings that change the numbers: batch limits, KV layout, chosen plugins."""
        info = self.llm.engine_info()
        cfg = info.config
        return {
            "model": self.model_ref,
            "loader": self.loader,
            "architecture": (getattr(self.hf_config, "architectures", None) or ["?"])[0],
            "device": info.device,
            "dtype": info.dtype,
            "max_num_seqs": cfg.scheduler.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "enable_chunked_prefill": cfg.scheduler.enable_chunked_prefill,
            "block_size": info.block_size,
            "num_kv_blocks": info.num_kv_blocks,
            "enable_prefix_caching": cfg.kv_cache.enable_prefix_caching,
            "max_model_len": info.max_model_len,
            "speculative": cfg.speculative.model_dump() if cfg.speculative.method else None,
            "plugins": dict(info.components),
            "build_seconds": round(self.build_seconds, 2),
        }

    def kv_stats(self) -> dict[str, float]:
        """Cumulative scheduler counters (diff two snapshots to get one run's share)."""
        stats = self.llm.get_stats()
        return {
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "num_steps": stats.num_steps,
            "spec_num_drafts": stats.spec_num_drafts,
            "spec_num_draft_tokens": stats.spec_num_draft_tokens,
            "spec_num_accepted_tokens": stats.spec_num_accepted_tokens,
        }

    def generate(self, workload: Workload, temperature: float = 0.0) -> list[Any]:
        """Run the whole workload through `LLM.generate`; each request makes exactly its output length."""
        from pagedllm.api.engine import SamplingParams

        params = [
            SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=temperature, detokenize=False)
            for n in workload.output_lens
        ]
        prompts = [{"prompt_token_ids": p} for p in workload.prompts]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        for out, n in zip(outputs, workload.output_lens, strict=True):
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            got = len(out.outputs[0].token_ids)
            assert got == n, f"request {out.request_id} made {got} tokens, expected {n} (ignore_eos)"
        return outputs

    def shutdown(self) -> None:
        self.llm.shutdown()


def kv_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """One run's share of the scheduler counters, with the prefix-cache hit rate over that run."""
    d = {k: after[k] - before[k] for k in before}
    queries = d["prefix_cache_queries"]
    d["prefix_cache_hit_rate"] = d["prefix_cache_hits"] / queries if queries else 0.0
    if d.get("spec_num_drafts"):  # speculative decoding: this run's acceptance
        d["spec_acceptance_rate"] = d["spec_num_accepted_tokens"] / d["spec_num_draft_tokens"]
        d["spec_mean_accepted_length"] = d["spec_num_accepted_tokens"] / d["spec_num_drafts"]
    return d


def thread_count() -> int:
    """Threads torch computes with (the engine sets it from --num-threads; baselines share it)."""
    import torch

    return torch.get_num_threads()


def load_average() -> list[float]:
    """1/5/15-minute load averages: a loaded machine makes every number here slower."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not on every platform
        return []
