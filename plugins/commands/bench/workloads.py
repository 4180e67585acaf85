"""Benchmark workloads: prompts as token ids plus an exact output length per request.

Every engine in a comparison (ours, transformers, llama.cpp) receives the same token ids, so nobody's
tokenizer or chat template enters the measurement, and `ignore_eos` / `min_new_tokens` make each request
produce exactly its output length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# NOTE(1): random ids are drawn above this floor. Most vocabularies keep special and byte-fallback tokens
# at the bottom; skipping them keeps control tokens out of prompts even where the tokenizer does not list
# them as special.
_ID_FLOOR = 100


class WorkloadError(ValueError):
    """A workload that cannot be built or cannot run on this engine; the CLI prints it without a traceback."""


@dataclass(frozen=True)
class Workload:
    """A list of requests: `prompts[i]` (token ids) must generate exactly `output_lens[i]` tokens."""

    prompts: list[list[int]]
    output_lens: list[int]
    source: str  # "random" or the prompts file

    def __post_init__(self) -> None:
        assert len(self.prompts) == len(self.output_lens), "one output length per prompt"
        assert all(p for p in self.prompts), "prompts must not be empty"

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, n: int) -> Workload:
        """The first n requests (the slow transformers baseline may run only a prefix)."""
        return Workload(self.prompts[:n], self.output_lens[:n], self.source)

    def describe(self) -> dict[str, Any]:
        """Summary for the JSON report: counts and min/mean/max of both lengths."""
        ins = [len(p) for p in self.prompts]
        return {
            "source": self.source,
            "num_requests": len(self),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "input_len": {"min": min(ins), "mean": float(np.mean(ins)), "max": max(ins)},
            "output_len": {"min": min(self.output_lens), "mean": float(np.mean(self.output_lens)),
                           "max": max(self.output_lens)},
        }


def parse_range(text: str | None, fixed: int) -> tuple[int, int]:
    """'LO:HI' -> (LO, HI) inclusive; None -> (fixed, fixed)."""
    if text is None:
        lo = hi = fixed
    else:
        try:
            lo_s, hi_s = text.split(":")
            lo, hi = int(lo_s), int(hi_s)
        except ValueError:
            raise WorkloadError(f"expected a range LO:HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise WorkloadError(f"a length range needs 1 <= LO <= HI, got {lo}:{hi}")
    return lo, hi


def allowed_token_ids(vocab_size: int, tokenizer: Any | None) -> np.ndarray:
    """Ids safe for random prompts: above the floor, inside the tokenizer's real vocabulary, not special."""
    hi = vocab_size
    if tokenizer is not None:
        # NOTE(2): config.vocab_size is often padded past the tokenizer (embedding rows with no token);
        # such ids are legal for the model but llama.cpp rejects them, so stay inside len(tokenizer).
        hi = min(hi, len(tokenizer))
    lo = min(_ID_FLOOR, max(hi // 4, 1))  # tiny test vocabularies still get most of their ids
    ids = np.arange(lo, hi, dtype=np.int64)
    special = list(getattr(tokenizer, "all_special_ids", None) or []) if tokenizer is not None else []
    if special:
        ids = np.setdiff1d(ids, np.asarray(special, dtype=np.int64))
    if ids.size == 0:
        raise WorkloadError(f"no usable token ids in a vocabulary of {vocab_size}")
    return ids


def random_workload(
    num_prompts: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    token_ids: np.ndarray,
    seed: int,
) -> Workload:
    """`num_prompts` prompts of uniform random ids, lengths uniform in the (inclusive) ranges."""
    if num_prompts < 1:
        raise WorkloadError(f"--num-prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_range[0], input_range[1] + 1, size=num_prompts)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_prompts)
    prompts = [rng.choice(token_ids, size=int(n)).tolist() for n in in_lens]
    return Workload(prompts, [int(o) for o in out_lens], "random")


def file_workload(
    path: str, tokenizer: Any | None, output_range: tuple[int, int], seed: int, num_prompts: int | None = None
) -> Workload:
    """One prompt per non-empty line, tokenized once here (plain text, no chat template)."""
    if tokenizer is None:
        raise WorkloadError("--prompts-file needs a model with a tokenizer (dummy weights have none)")
    with open(path) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    if num_prompts is not None:
        lines = lines[:num_prompts]
    if not lines:
        raise WorkloadError(f"{path} holds no prompts")
    prompts = [list(tokenizer(line).input_ids) for line in lines]
    rng = np.random.default_rng(seed)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, size=len(prompts))
    return Workload(prompts, [int(o) for o in out_lens], path)


def check_fits(workload: Workload, max_model_len: int) -> None:
    """Fail before timing if a request cannot fit the engine's context, rather than mid-run."""
    worst = max(len(p) + o for p, o in zip(workload.prompts, workload.output_lens, strict=True))
    if worst > max_model_len:
        raise WorkloadError(
            f"a request needs {worst} tokens (prompt + output) but max_model_len is {max_model_len}; "
            "shorten the lengths or raise --max-model-len / the KV cache"
        )
