"""The CPU engine's batch limits and KV-cache size, chosen from the machine where the config leaves them unset.

Three sizes, each returned with the reason `pagedllm config show --resolve` and the start-up log print (the
way platform/cpu_compute.py explains the dtype). A value the config gives (file, environment, flag, keyword)
always wins; a KV size that cannot fit in the memory available is refused, naming its key.

1. `scheduler.max_num_seqs`: 64 per physical core, within 64..256 (NOTE 1), and no more than the safe KV
   budget holds requests of SIZING_LEN tokens.
2. `scheduler.max_num_batched_tokens`: 1024 per physical core, within 2048..4096, and at least max_num_seqs
   (NOTE 2).
3. The KV cache (`kv_cache.memory_gb`): room for max_num_seqs requests of SIZING_LEN tokens at once, and for
   one request of max_model_len; never less than the old fixed default (1 GiB) and never more than
   KV_MEMORY_SHARE of the memory available once the weights are loaded (NOTE 3).

NOTE 1: a CPU decode step reads every weight once whatever the batch, so more sequences per step share that
read until the per-token compute dominates. Issue 30 measured it on 2 cores (AMD EPYC Zen 4): the 128-prompt
batch (128 x (128 in, 128 out)) ran 29 % faster with `--max-num-seqs 128 --kv-cache-memory-gb 1.6` than at
the old fixed 64 sequences and 1 GiB, which ran it in two waves (docs/cpu.md, "Batch and KV sizes"). The
ceiling is vLLM's CPU default per rank for offline batches (256, engine/arg_utils.py get_batch_defaults);
beyond the compute-bound point a larger batch only lengthens each step.
NOTE 2: a step's length is its tokens over the cores, and a prefill chunk stalls every running decode for that
long. 1024 tokens per core keeps that stall about the same on any machine while bigger machines run larger
GEMMs; 2048 is the old fixed default (and vLLM's CPU default for its server), 4096 vLLM's CPU default for
offline batches. A decode step of max_num_seqs requests must fit in one step's budget.
NOTE 3: the cache is zeroed at start-up, so every byte planned is resident from the first request on. Planning
at most half of what is available after the weights keeps room for activations, the tokenizer and other
processes: a second engine started on the same machine then plans at most half of what the first left. vLLM's
CPU worker instead plans a fraction of *total* memory less its own RSS (v1/worker/cpu_worker.py), which
overcommits a shared machine; like it, an explicit size larger than what is available is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.platform.host_memory import HostMemory

SEQS_PER_CORE, MIN_SEQS, MAX_SEQS = 64, 64, 256  # NOTE 1
TOKENS_PER_CORE, MIN_TOKENS, MAX_TOKENS = 1024, 2048, 4096  # NOTE 2
KV_MEMORY_SHARE = 0.5  # NOTE 3: of the memory available once the weights are loaded
KV_FLOOR_BYTES = 1 << 30  # the old fixed kv_cache.memory_gb default: what small models already had
SIZING_LEN = 512  # the request length (prompt + output) max_num_seqs requests are given KV room for

_GIB = float(1 << 30)


@dataclass(frozen=True)
class RequestedSizes:
    """What the config sets explicitly (None = left unset, so sized here)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    memory_gb: float | None = None
    num_blocks: int | None = None


@dataclass(frozen=True)
class CpuSizingInputs:
    """The machine and the model, as the sizing rule sees them.

    :param blocks_per_request: need(L, chunk): KV blocks one request of L tokens holds at once when prefilled in
        chunks of `chunk` tokens (kv_cache/capacity.py KVCapacity.blocks_per_request).
    :param memory: what this process may still take, read after the weights were loaded.
    """

    physical_cores: int
    memory: HostMemory
    weights_bytes: int
    bytes_per_block: int
    blocks_per_request: Callable[[int, int], int]
    max_model_len: int
    requested: RequestedSizes = RequestedSizes()


@dataclass(frozen=True)
class CpuSizing:
    """The sizes and why. `kv_bytes` None: the config's own `kv_cache.num_blocks` sizes the cache."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_bytes: int | None
    reasons: tuple[str, ...]


class CpuSizingError(ValueError):
    """A configured size that cannot fit in this machine's memory; the message names the key."""


def size_cpu_engine(inputs: CpuSizingInputs) -> CpuSizing:
    """max_num_seqs, the step's token budget and the KV cache's bytes for a CPU engine (the module's rules)."""
    req = inputs.requested
    cores = max(1, inputs.physical_cores)
    available = inputs.memory.available_bytes
    _check_explicit_kv(inputs)
    ceiling = None if available is None else int(KV_MEMORY_SHARE * available)

    budget, budget_reason = _token_budget(req, cores)
    seqs, seqs_reason = _max_num_seqs(inputs, cores, budget, ceiling)
    if req.max_num_batched_tokens is None and budget < seqs:
        budget = seqs
        budget_reason += f", raised to max_num_seqs {seqs} so a full decode step fits"
    kv_bytes, kv_reason = _kv_bytes(inputs, seqs, budget, ceiling)
    return CpuSizing(seqs, budget, kv_bytes, (seqs_reason, f"max_num_batched_tokens {budget} ({budget_reason})",
                                              kv_reason))


def _token_budget(req: RequestedSizes, cores: int) -> tuple[int, str]:
    if req.max_num_batched_tokens is not None:
        return req.max_num_batched_tokens, "scheduler.max_num_batched_tokens (config)"
    budget = min(MAX_TOKENS, max(MIN_TOKENS, TOKENS_PER_CORE * cores))
    return budget, (f"sized from the machine: {TOKENS_PER_CORE} per physical core x {cores}, within "
                    f"{MIN_TOKENS}..{MAX_TOKENS}; scheduler.max_num_batched_tokens sets it")


def _max_num_seqs(inputs: CpuSizingInputs, cores: int, budget: int, ceiling: int | None) -> tuple[int, str]:
    req = inputs.requested
    if req.max_num_seqs is not None:
        return req.max_num_seqs, f"max_num_seqs {req.max_num_seqs} (scheduler.max_num_seqs, config)"
    seqs = min(MAX_SEQS, max(MIN_SEQS, SEQS_PER_CORE * cores))
    why = f"sized from the machine: {SEQS_PER_CORE} per physical core x {cores}, within {MIN_SEQS}..{MAX_SEQS}"
    if req.max_num_batched_tokens is not None and req.max_num_batched_tokens < seqs:
        seqs = req.max_num_batched_tokens
        why += f", lowered to scheduler.max_num_batched_tokens {seqs} (a decode step's tokens)"
    if ceiling is not None and req.memory_gb is None and req.num_blocks is None:
        per_request = _request_bytes(inputs, budget)
        holds = max(1, (ceiling - inputs.bytes_per_block) // per_request)
        if holds < seqs:
            seqs = holds
            why += (f", lowered to the {holds} requests of {_sizing_len(inputs)} tokens that "
                    f"{KV_MEMORY_SHARE:.0%} of the available memory holds")
    return seqs, f"max_num_seqs {seqs} ({why}; scheduler.max_num_seqs sets it)"


def _kv_bytes(inputs: CpuSizingInputs, seqs: int, budget: int, ceiling: int | None) -> tuple[int | None, str]:
    req = inputs.requested
    bpb = inputs.bytes_per_block
    if req.num_blocks is not None:
        return None, f"kv cache {req.num_blocks} blocks ({req.num_blocks * bpb / _GIB:.2f} GiB; kv_cache.num_blocks, config)"
    if req.memory_gb is not None:
        return int(req.memory_gb * _GIB), f"kv cache {req.memory_gb:g} GiB (kv_cache.memory_gb, config)"
    if ceiling is None:
        return KV_FLOOR_BYTES, (f"kv cache {KV_FLOOR_BYTES / _GIB:.1f} GiB (the available memory could not be read: "
                                "the fixed default; kv_cache.memory_gb sets it)")
    length = _sizing_len(inputs)
    # One block is the null block (kv_cache/capacity.py): never handed to a request.
    wanted = bpb * (1 + max(seqs * inputs.blocks_per_request(length, budget),
                            inputs.blocks_per_request(inputs.max_model_len, budget)))
    kv = min(ceiling, max(KV_FLOOR_BYTES, wanted))
    avail = inputs.memory.available_bytes or 0
    why = (f"room for {seqs} requests of {length} tokens and one of max_model_len {inputs.max_model_len} "
           f"({wanted / _GIB:.2f} GiB at {bpb:,} bytes a block)")
    if kv == ceiling:
        why += f", cut to {KV_MEMORY_SHARE:.0%} of"
    else:
        why += (f", at least the fixed default {KV_FLOOR_BYTES / _GIB:.0f} GiB" if kv == KV_FLOOR_BYTES else "")
        why += f", at most {KV_MEMORY_SHARE:.0%} of"
    why += (f" the {avail / _GIB:.1f} GiB available ({inputs.memory.source}) with the weights "
            f"({inputs.weights_bytes / _GIB:.2f} GiB) loaded")
    return kv, f"kv cache {kv / _GIB:.2f} GiB (sized from the machine: {why}; kv_cache.memory_gb sets it)"


def _check_explicit_kv(inputs: CpuSizingInputs) -> None:
    """An explicit cache larger than the memory available cannot be allocated without swapping or the OOM
    killer: refused before the allocation, naming the key (as vLLM's CPU worker does)."""
    req = inputs.requested
    available = inputs.memory.available_bytes
    if available is None:
        return
    if req.num_blocks is not None:
        key, value, wanted = "kv_cache.num_blocks", f"{req.num_blocks}", req.num_blocks * inputs.bytes_per_block
    elif req.memory_gb is not None:
        key, value, wanted = "kv_cache.memory_gb", f"{req.memory_gb:g}", int(req.memory_gb * _GIB)
    else:
        return
    if wanted > available:
        raise CpuSizingError(
            f"{key} {value}: the KV cache would take {wanted / _GIB:.2f} GiB but only {available / _GIB:.2f} GiB "
            f"is available ({inputs.memory.source}) with the weights ({inputs.weights_bytes / _GIB:.2f} GiB) "
            f"loaded; lower {key}, or leave it unset to size the cache from the machine"
        )


def _sizing_len(inputs: CpuSizingInputs) -> int:
    return min(SIZING_LEN, inputs.max_model_len)


def _request_bytes(inputs: CpuSizingInputs, budget: int) -> int:
    return max(1, inputs.blocks_per_request(_sizing_len(inputs), budget)) * inputs.bytes_per_block
