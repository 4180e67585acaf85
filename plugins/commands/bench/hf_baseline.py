"""The Hugging Face transformers baseline: `model.generate` on the same weights and the same token ids.

transformers has no continuous batching in `generate`, so throughput uses static batches: each batch is
left-padded to its longest prompt and decodes until its longest output is done. That waste is the
baseline's real cost, so only the requested tokens count toward its tok/s.
"""

from __future__ import annotations

import time
from typing import Any

from pagedllm.plugins.commands.bench.report import Result, gaps, latency_result
from pagedllm.plugins.commands.bench.target import BenchTarget
from pagedllm.plugins.commands.bench.workloads import Workload, WorkloadError


def load_hf_model(target: BenchTarget, dtype: str = "float32") -> Any:
    """The transformers model for the engine's weights: a GGUF (dequantized), an HF folder, or random.

    For `--load-format dummy` the weights cannot match ours, so the model is built from the same config
    with a fixed seed: the comparison is then of speed only, which random weights do not change.
    """
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # generation-flag chatter would bury the table
    transformers.utils.logging.disable_progress_bar()  # the GGUF dequantization bar, likewise
    torch_dtype = getattr(torch, dtype)
    cls = transformers.AutoModelForCausalLM
    if target.loader == "gguf":
        import os

        folder, name = os.path.split(os.path.abspath(target.model_ref))
        model = cls.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
    elif target.loader == "dummy":
        torch.manual_seed(target.seed)
        # The engine reads config.json with its own reader (no transformers classes): transformers reads the
        # same folder for its model.
        config = transformers.AutoConfig.from_pretrained(target.model_ref, local_files_only=True)
        model = cls.from_config(config, dtype=torch_dtype)
    else:
        model = cls.from_pretrained(target.model_ref, dtype=torch_dtype)
    return model.eval()


def _pad_id(model: Any) -> int:
    gen = model.generation_config
    for cand in (gen.pad_token_id, gen.eos_token_id, 0):
        if isinstance(cand, list):
            cand = cand[0] if cand else None
        if cand is not None:
            return int(cand)
    return 0


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    """input_ids and attention_mask for a left-padded batch (generation continues at the right edge)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def _generate(model: Any, prompts: list[list[int]], new_tokens: int, streamer: Any = None) -> Any:
    import torch

    ids, mask = _left_pad(prompts, _pad_id(model))
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # with max: exactly `new_tokens`, EOS or not (our ignore_eos)
            pad_token_id=_pad_id(model),
            streamer=streamer,
        )
    assert out.shape[1] == ids.shape[1] + new_tokens, "transformers stopped early"
    return out


def hf_throughput(model: Any, workload: Workload, batch_size: int, warmup: bool = True) -> Result:
    """Static batches of `batch_size` in workload order; elapsed covers every batch, tokens are the requested."""
    if batch_size < 1:
        raise WorkloadError(f"--hf-batch-size must be >= 1, got {batch_size}")
    if warmup:
        _generate(model, [p[:8] for p in workload.prompts[:2]], 4)
    generated = 0
    t0 = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        prompts = workload.prompts[start:start + batch_size]
        new_tokens = max(workload.output_lens[start:start + batch_size])
        _generate(model, prompts, new_tokens)
        generated += new_tokens * len(prompts)
    elapsed = time.perf_counter() - t0
    return {
        "num_requests": len(workload),
        "elapsed_s": elapsed,
        "requests_per_s": len(workload) / elapsed,
        "output_tok_per_s": workload.output_tokens / elapsed,
        "total_tok_per_s": (workload.prompt_tokens + workload.output_tokens) / elapsed,
        "batch_size": batch_size,
        "generated_tokens": generated,  # includes tokens past a request's own length (static batching)
    }


class _StepClock:
    """A transformers streamer that only notes when each decoding step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if not self._seen_prompt:  # generate first hands over the prompt itself
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_latency(model: Any, iterations: list[list[list[int]]], output_len: int, warmup: bool = True) -> Result:
    """Decode each iteration's batch (equal-length prompts, so no padding) and time every step."""
    if warmup:
        _generate(model, [p[:8] for p in iterations[0]], 4)
    ttfts: list[float] = []
    itls: list[float] = []
    e2e: list[float] = []
    for batch in iterations:
        clock = _StepClock()
        t0 = time.perf_counter()
        _generate(model, batch, output_len, streamer=clock)
        e2e.append(time.perf_counter() - t0)
        ttfts.append(clock.times[0] - t0)
        itls += gaps(clock.times)
    return latency_result(ttfts, itls, e2e, len(iterations[0]), len(iterations[0][0]), output_len)

