"""Registers the `flash_attn` attention backend: FlashAttention's paged varlen kernels (NVIDIA GPUs).

Three libraries ship FlashAttention, and whichever fits the GPU is used (the choice is in the description,
in `pagedllm plugins` and in the engine's start-up report):

    variant  package (import)                         GPUs               paged KV page size
    fa4      flash-attn-4 (flash_attn.cute)           sm 9.x, 10.x, 11.x any (16 and 128 ran on the H200)
    fa3      flash-attn-3 (flash_attn_interface)      sm 9.x             any
    fa2      flash-attn (flash_attn)                  sm 8.0+            a multiple of 256 (upstream check)

fa4 4.0.0b36's own limits (flash_attn/cute/interface.py), which check() turns into reasons: head size 8..256
on 9.x but at most 128 or exactly 256 on 10.x/11.x; fp16/bf16 (its fp8 needs an fp8 query, Blackwell only);
page_table int32 (the engine's block table is); paged KV only on 9.x-11.x (it asserts against 8.x and 12.x,
hence the variant's range); any page size (page == 128, its tile, loads pages by TMA; others by cp.async); no
batch limit (above 256 requests a batch-lookup aid is built: another kernel variant). Not refused, but
slower: fa4 has no split-KV on 9.x, so a decode step with few requests runs num_kv_heads x requests CTAs
over the whole context (W3-style single-request decode: 8 CTAs on 132 SMs).

On Hopper fa3 is preferred when both it and fa4 are installed (the mature kernel; fa4 is still beta on
sm 9.x); on Blackwell only fa4 runs. PyPI has only flash-attn's source, so fa2/fa3 exist only where users
built them. Detection reads installed files and metadata only -- importing flash_attn.cute costs 8-9 s and
flash_attn pulls in torch and its CUDA extension -- so this module stays light.

Rank (vLLM's order): above FlashInfer on Ampere/Hopper, below it on Blackwell (10.x); below triton when the
engine captures decode CUDA graphs (priority_for): fa2/fa3 decode eagerly, and fa4, which decodes in graphs
(flash_attn/backend.py NOTE), measured on the H200 W3 4.31 ms/token and W2 (0.25 scale) 14,116 tok/s against
triton's 4.35 and ~15,000 -- its prefill is faster (456 vs 317 TFLOP/s), its decode steps no better.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.api import AttentionSelectionContext, RegisterAttentionBackend, hookimpl

PRIORITY = 110  # Ampere/Hopper: FlashAttention > FlashInfer (100) > triton (50) > torch (0)
PRIORITY_BLACKWELL = 90  # compute capability 10.x: FlashInfer first
EAGER_PRIORITY = 40  # decode CUDA graphs wanted: below triton (50); see priority_for


@dataclass(frozen=True)
class Variant:
    """One installed FlashAttention library and the GPUs and layouts it serves."""

    name: str  # fa4, fa3, fa2
    module: str  # what the backend imports
    distribution: str
    version: str
    min_cc: tuple[int, int]
    max_major: int  # highest compute-capability major it runs on
    page_multiple: int  # the paged KV page size must be a multiple of this

    def label(self) -> str:
        return f"{self.name} ({self.distribution} {self.version})".replace(" )", ")")


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _package_dir(name: str) -> Path | None:
    """The folder of a top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def installed_variants() -> tuple[Variant, ...]:
    """Every FlashAttention library installed here, most preferred first (see the table above)."""
    found = []
    fa_dir = _package_dir("flash_attn")
    if fa_dir is not None and (fa_dir / "cute" / "interface.py").exists():
        found.append(Variant("fa4", "flash_attn.cute.interface", "flash-attn-4",
                             _version("flash-attn-4") or "?", (9, 0), 11, 1))
    try:
        fa3 = importlib.util.find_spec("flash_attn_interface") is not None
    except (ImportError, ValueError):
        fa3 = False
    if fa3:
        found.append(Variant("fa3", "flash_attn_interface", "flash-attn-3",
                             _version("flash_attn_3", "flash-attn-3") or "?", (9, 0), 9, 1))
    if fa_dir is not None and (fa_dir / "flash_attn_interface.py").exists():
        found.append(Variant("fa2", "flash_attn", "flash-attn", _version("flash-attn", "flash_attn") or "?",
                             (8, 0), 12, 256))
    # Hopper prefers fa3 over fa4 (module docstring): order fa3, fa4, fa2; per-GPU filtering is in choose().
    order = {"fa3": 0, "fa4": 1, "fa2": 2}
    return tuple(sorted(found, key=lambda v: order[v.name]))


def _rejects(variant: Variant, ctx: Any) -> list[str]:
    """Why `variant` cannot serve `ctx` on this GPU (empty: it can)."""
    reasons = []
    cc = ctx.compute_capability
    if cc is not None and (cc < variant.min_cc or cc[0] > variant.max_major):
        reasons.append(f"compute capability {cc} outside {variant.min_cc[0]}.x-{variant.max_major}.x")
    if ctx.block_size % variant.page_multiple:
        reasons.append(f"block size {ctx.block_size} is not a multiple of {variant.page_multiple}")
    if variant.name == "fa4" and cc is not None and cc[0] in (10, 11) and 128 < ctx.head_size != 256:
        # flash-attn-4's _validate_head_dims: Blackwell runs 8..128 and 256 (192 only as DeepSeek's 192/128
        # K/V pair, which one head size cannot express); Hopper runs 8..256, the shared check below.
        reasons.append(f"head size {ctx.head_size} not supported by fa4 on compute capability {cc[0]}.x "
                       "(at most 128, or 256)")
    return reasons


def choose(ctx: Any) -> tuple[Variant | None, list[str]]:
    """The variant that serves `ctx`, or None with every installed variant's reasons."""
    reasons = []
    for variant in installed_variants():
        against = _rejects(variant, ctx)
        if not against:
            return variant, []
        reasons.append(f"{variant.label()}: {', '.join(against)}")
    return None, reasons


def check(ctx: AttentionSelectionContext) -> list[str]:
    """Why no FlashAttention library can serve `ctx` (empty: one can; `choose` says which)."""
    variants = installed_variants()
    if not variants:
        return ["no FlashAttention library installed (flash-attn-4 for flash_attn.cute, flash-attn-3 for "
                "flash_attn_interface, or a source build of flash-attn)"]
    reasons = []
    if ctx.device_type != "cuda":
        reasons.append(f"device {ctx.device_type}: needs cuda")
    if ctx.dtype not in ("float16", "bfloat16"):
        reasons.append(f"dtype {ctx.dtype} not supported (float16/bfloat16 only)")
    if ctx.kv_cache_dtype not in ("auto", ctx.dtype):
        # FA3 reads fp8 K/V only with an fp8 query (descale factors); FA4 and FA2 have no fp8 path.
        reasons.append(f"kv cache dtype {ctx.kv_cache_dtype} not supported (only the model dtype)")
    if ctx.head_size > 256 or ctx.head_size % 8:
        reasons.append(f"head size {ctx.head_size} not supported (a multiple of 8, at most 256)")
    if ctx.sinks:
        reasons.append("attention sinks not supported (this backend does not pass them to FlashAttention)")
    if ctx.chunked_local:
        reasons.append("chunked local attention not supported (this backend passes FlashAttention no chunk mask; "
                       "the torch and flex backends apply it)")
    if ctx.device_type == "cuda":
        variant, why = choose(ctx)
        if variant is None:
            reasons.extend(why)
    return reasons


def priority_for(ctx: AttentionSelectionContext) -> int:
    """vLLM's per-GPU order: below FlashInfer on Blackwell (10.x), above it elsewhere.

    An engine that captures decode CUDA graphs ranks it below triton: fa2/fa3 decode eagerly (launch-bound
    single-request decode), and fa4's graph decode measured no faster than triton's (module docstring).
    """
    if ctx.cuda_graphs:
        return EAGER_PRIORITY
    cc = ctx.compute_capability
    return PRIORITY_BLACKWELL if cc is not None and cc[0] == 10 else PRIORITY


def _load() -> Any:
    from pagedllm.plugins.attention.flash_attn.backend import FlashAttnBackend, preload

    preload()  # import the library now: a broken install fails at selection.load(), naming this plugin
    return FlashAttnBackend


def _description() -> str:
    variants = installed_variants()
    have = ", ".join(v.label() for v in variants) if variants else "none installed"
    return f"FlashAttention paged varlen (fa3/fa4/fa2, whichever fits the GPU; here: {have})"


@hookimpl
def register_attention_backends(register: RegisterAttentionBackend) -> None:
    register(
        "flash_attn", _load, priority=PRIORITY, check=check, description=_description(),
        priority_for=priority_for,
    )
