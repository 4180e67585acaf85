"""Which checkpoint layers a fused layer stands for, so per-layer skip lists written against the checkpoint work.

Quantizers name the checkpoint's layers (`...self_attn.q_proj`); our models fuse some of them (`qkv_proj`,
`gate_up_proj`). A fused layer is skipped only when every piece is; a partly skipped fused layer cannot be
built (one layer, one method) and is refused with the names.
"""

from __future__ import annotations

from collections.abc import Callable

FUSED_PIECES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_names(prefix: str) -> list[str]:
    """The checkpoint layer names behind our layer `prefix` (itself when it is not fused)."""
    head, _, last = prefix.rpartition(".")
    pieces = FUSED_PIECES.get(last)
    if pieces is None:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in pieces]


def is_skipped(prefix: str, skipped: Callable[[str], bool]) -> bool:
    """True when every checkpoint layer behind `prefix` is skipped; ValueError when only some are."""
    names = checkpoint_names(prefix)
    flags = [skipped(n) for n in names]
    if any(flags) and not all(flags):
        kept = [n for n, f in zip(names, flags) if not f]
        raise ValueError(
            f"{prefix}: the quantization config skips only some of its fused pieces (still quantized: "
            f"{', '.join(kept)}); a fused layer needs one method"
        )
    return all(flags)
