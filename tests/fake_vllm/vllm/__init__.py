"""A stand-in for vLLM's offline surface, for the bench's vLLM-baseline protocol tests (no vLLM in CI).

It is an engine, not a canned answer: a toy model whose next token is a function of the last one, which
makes as many tokens as each request's SamplingParams ask for, stops at its EOS unless ignore_eos, and
refuses what the bench must never ask of vLLM (sampling, detokenization without a tokenizer). It records
what it was given in $FAKE_VLLM_RECORD (JSON lines), so a test can check the prompts and the environment
that reached it. $FAKE_VLLM_SHORT=1 makes every request one token short (a baseline that ran wrong).
"""

from __future__ import annotations

import enum
import json
import os
import time
from types import SimpleNamespace
from typing import Any

__version__ = "0.0.0+fake"
EOS = 2
VOCAB = 97


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


sampling_params = SimpleNamespace(RequestOutputKind=RequestOutputKind)


class SamplingParams:
    def __init__(self, temperature: float = 1.0, max_tokens: int = 16, min_tokens: int = 0, ignore_eos: bool = False,
                 detokenize: bool = True, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        if temperature != 0.0:
            raise ValueError("the fake model decodes greedily only")
        self.max_tokens, self.min_tokens, self.ignore_eos = max_tokens, min_tokens, ignore_eos
        self.detokenize, self.output_kind = detokenize, output_kind


def _record(event: dict[str, Any]) -> None:
    path = os.environ.get("FAKE_VLLM_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def _decode(prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy toy decode: next = (31 * last + 7) % VOCAB, until max_tokens (or EOS without ignore_eos)."""
    out: list[int] = []
    last = prompt[-1]
    limit = params.max_tokens - (1 if os.environ.get("FAKE_VLLM_SHORT") == "1" else 0)
    while len(out) < limit:
        last = (31 * last + 7) % VOCAB
        out.append(last)
        if last == EOS and not params.ignore_eos and len(out) >= params.min_tokens:
            break
    return out


def _output(rid: str, prompt: list[int], tokens: list[int]) -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, num_cached_tokens=0,
                           outputs=[SimpleNamespace(token_ids=tokens)])


class _Engine:
    """LLMEngine's stepping surface: every unfinished request gains one token per step."""

    def __init__(self, config: Any) -> None:
        self.vllm_config = config
        self._live: dict[str, tuple[list[int], list[int], int]] = {}  # id -> (prompt, planned, made)

    def add_request(self, rid: str, prompt: dict[str, list[int]], params: SamplingParams) -> None:
        if params.detokenize:
            raise ValueError("skip_tokenizer_init: cannot detokenize")
        _record({"event": "add_request", "prompt": prompt["prompt_token_ids"]})
        self._live[rid] = (prompt["prompt_token_ids"], _decode(prompt["prompt_token_ids"], params), 0)

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def step(self) -> list[Any]:
        time.sleep(0.001)  # a step takes time, so token stamps differ
        outs = []
        for rid, (prompt, planned, made) in list(self._live.items()):
            outs.append(_output(rid, prompt, planned[made:made + 1]))  # DELTA: only the new token
            if made + 1 >= len(planned):
                del self._live[rid]
            else:
                self._live[rid] = (prompt, planned, made + 1)
        return outs


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"{model} is not an HF folder (no config.json)")
        _record({"event": "init", "model": model, "kwargs": kwargs,
                 "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}})
        config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=4096, enable_chunked_prefill=True),
            cache_config=SimpleNamespace(block_size=128, enable_prefix_caching=kwargs.get("enable_prefix_caching"),
                                         kv_cache_memory_bytes=int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")) << 30),
            model_config=SimpleNamespace(max_model_len=kwargs.get("max_model_len"), dtype=kwargs.get("dtype")),
            compilation_config=SimpleNamespace(mode="fake"),
        )
        self.llm_engine = _Engine(config)

    def generate(self, prompts: list[dict[str, list[int]]], params: list[SamplingParams], use_tqdm: bool = True) -> list[Any]:
        outs = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            if p.detokenize:
                raise ValueError("skip_tokenizer_init: cannot detokenize")
            ids = prompt["prompt_token_ids"]
            outs.append(_output(str(i), ids, _decode(ids, p)))
            time.sleep(0.002 * len(outs[-1].outputs[0].token_ids))  # decoding takes time, as a model's would
        _record({"event": "generate", "prompts": [p["prompt_token_ids"] for p in prompts]})
        return outs
