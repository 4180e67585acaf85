"""check_attention_backend: a backend against the in-tree torch reference on random paged batches.

Each case is one batch of requests, request i with `contexts[i]` tokens already in the cache and `queries[i]`
new ones, ordered decodes first as the scheduler orders them; blocks are random ids (block 0, the null block,
never used), so block tables are not contiguous. It runs as two steps through both backends:

    step 1 (history)  every request with a context writes it: a fresh prefill of `contexts[i]` tokens
    step 2 (the case) the new tokens: decodes, fresh prefills, chunks continuing the cached prefix

so each backend reads in step 2 the K/V it wrote itself in step 1, through its own cache layout. Outputs of
both steps must match the reference within the dtype's tolerance; when the backend keeps the reference's
layout (same `kv_cache_shape`), its cache must also equal the reference's bit for bit after each step (the
same slots written with the same values, every other slot untouched).

Cases needing a sliding window or a logits soft-cap run only when the backend's registration check accepts
them; every case's selection context goes through that check, so a backend is only held to what it claims.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.plugin_spec import ComponentSpec, PluginKind
from pagedllm.protocols.attention import AttentionLayerConfig, CommonAttentionMetadata
from pagedllm.selection_context import AttentionSelectionContext
from pagedllm.testing.compare import assert_close, tolerance
from pagedllm.testing.components import NotApplicable, find_spec, manager_or_default

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager


@dataclass(frozen=True)
class AttentionCase:
    """One batch: per request the cached tokens and the new ones (decodes, query length 1, first)."""

    name: str
    contexts: tuple[int, ...]
    queries: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA by default: two query heads per KV head
    head_size: int = 16
    block_size: int = 4
    sliding_window: int | None = None
    logits_soft_cap: float | None = None


# Small on purpose: the triton backend runs these under its CPU interpreter (TRITON_INTERPRET=1).
DEFAULT_CASES: tuple[AttentionCase, ...] = (
    # fresh prompts, both ending inside a block
    AttentionCase("prefill", (0, 0), (7, 5)),
    # decode-only: contexts of 6, 9, 4 and 13 after the step (partial and exactly full last blocks)
    AttentionCase("decode", (5, 8, 3, 12), (1, 1, 1, 1)),
    # decodes, a fresh prompt, and a chunk continuing a 5-token cached prefix
    AttentionCase("mixed_chunked", (5, 8, 0, 5), (1, 1, 7, 6)),
    # chunks whose cached prefix ends on a block boundary
    AttentionCase("chunk_after_full_blocks", (8, 4), (5, 9)),
    # one KV head for all query heads, a larger head
    AttentionCase("mqa", (3, 0), (1, 10), num_heads=4, num_kv_heads=1, head_size=32),
    # as many KV heads as query heads
    AttentionCase("mha", (6, 0), (1, 9), num_heads=2, num_kv_heads=2),
    # pages of 16: contexts spanning one and two blocks
    AttentionCase("block16", (20, 0, 17), (1, 18, 15), block_size=16),
    AttentionCase("sliding_window", (9, 0, 6), (1, 9, 5), sliding_window=5),
    AttentionCase("soft_cap", (9, 0, 6), (1, 9, 5), logits_soft_cap=2.0),
    AttentionCase("window_and_soft_cap", (9, 0, 6), (1, 9, 5), sliding_window=3, logits_soft_cap=1.5),
)


@dataclass
class AttentionReport:
    """What ran: case names, the skipped ones with their registration check's reasons, worst errors."""

    backend: str
    ran: list[str] = field(default_factory=list)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    max_rel_error: float = 0.0
    same_layout: bool = True


def check_attention_backend(
    backend: str | type,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    *,
    cases: Sequence[AttentionCase] = DEFAULT_CASES,
    reference: str = "torch",
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    plugin_manager: PluginManager | None = None,
) -> AttentionReport:
    """Run `backend` (a registered name, or the backend class itself) against `reference` on `cases`.

    A class is held to the registration check of the component registered under its `name` attribute, if
    any (a subclass of a registered backend inherits its name); otherwise every case runs. Raises
    AssertionError on the first mismatch, NotApplicable when the check refuses every case.
    """
    pm = manager_or_default(plugin_manager)
    device = torch.device(device)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    rtol, atol = tolerance(dtype, rtol, atol)
    cls, spec = _backend_and_spec(backend, pm)
    ref_cls = find_spec(PluginKind.ATTENTION, reference, pm).resolve()
    label = spec.name if spec is not None and isinstance(backend, str) else getattr(cls, "__name__", str(cls))
    report = AttentionReport(label)
    for i, case in enumerate(cases):
        reasons = _reasons_against(spec, case, device, dtype)
        if reasons:
            report.skipped[case.name] = reasons
            continue
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        rel, same = _run_case(cls, ref_cls, case, device, dtype, gen, rtol, atol, label)
        report.ran.append(case.name)
        report.max_rel_error = max(report.max_rel_error, rel)
        report.same_layout = report.same_layout and same
    if not report.ran:
        why = "; ".join(f"{name}: {', '.join(r)}" for name, r in report.skipped.items())
        raise NotApplicable(f"attention backend {label} refuses every case here: {why}")
    return report


def _backend_and_spec(backend: str | type, pm: PluginManager) -> tuple[Any, ComponentSpec | None]:
    if isinstance(backend, str):
        found = find_spec(PluginKind.ATTENTION, backend, pm)
        return found.resolve(), found
    name = getattr(backend, "name", None)
    spec = pm.get(PluginKind.ATTENTION, name) if isinstance(name, str) else None
    return backend, spec


def _reasons_against(
    spec: ComponentSpec | None, case: AttentionCase, device: torch.device, dtype: torch.dtype
) -> list[str]:
    """What the backend's registration check says about this case (nothing when there is no registration)."""
    if spec is None:
        return []
    ctx = AttentionSelectionContext(
        device_type=device.type,
        compute_capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype="auto",
        head_size=case.head_size,
        block_size=case.block_size,
        sliding_window=case.sliding_window is not None,
        logits_soft_cap=case.logits_soft_cap is not None,
    )
    return spec.reasons_against(ctx)


def _run_case(
    cls: Any,
    ref_cls: Any,
    case: AttentionCase,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    rtol: float,
    atol: float,
    label: str,
) -> tuple[float, bool]:
    """Both steps of one case through both backends; returns (worst relative error, same cache layout)."""
    if len(case.contexts) != len(case.queries):
        raise ValueError(f"case {case.name}: {len(case.contexts)} contexts for {len(case.queries)} queries")
    bs, kvh, hs = case.block_size, case.num_kv_heads, case.head_size
    lengths = [c + q for c, q in zip(case.contexts, case.queries, strict=True)]
    num_blocks = sum(-(-n // bs) for n in lengths) + 2
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is the null block
    block_ids: list[list[int]] = []
    for n in lengths:
        take = -(-n // bs)
        block_ids.append(perm[:take])
        perm = perm[take:]
    # Every position's q/k/v, drawn once: both steps and both backends see the same numbers.
    qkv = [_rows(n, case, gen) for n in lengths]
    steps = _steps(case, block_ids, device)
    layer = AttentionLayerConfig(case.num_heads, hs, kvh, hs**-0.5, case.sliding_window, case.logits_soft_cap)

    ref_shape = tuple(ref_cls.kv_cache_shape(num_blocks, bs, kvh, hs))
    shape = tuple(cls.kv_cache_shape(num_blocks, bs, kvh, hs))
    ref_cache = torch.randn(ref_shape, generator=gen).to(device=device, dtype=dtype)
    # Same layout: start from the same (random) contents, so a write to a wrong slot shows in the comparison.
    cache = ref_cache.clone() if shape == ref_shape else torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    ref_impl, impl = ref_cls.make_impl(layer), cls.make_impl(layer)
    worst = 0.0
    for step_name, (common, rows) in steps.items():
        q, k, v = _step_tensors(qkv, rows, case, device, dtype)
        expected = ref_impl.forward(q, k, v, ref_cache, ref_cls.build_metadata(common))
        what = f"attention backend {label}, case {case.name!r} ({_describe(case)}), {step_name}"
        try:
            got = impl.forward(q, k, v, cache, cls.build_metadata(common))
        except Exception as exc:
            raise AssertionError(f"{what}: raised {type(exc).__name__}: {exc}") from exc
        if got.dtype != q.dtype:
            raise AssertionError(f"{what}: output dtype {got.dtype}, expected the query's {q.dtype}")
        worst = max(worst, assert_close(got, expected, rtol=rtol, atol=atol, what=f"{what}: output"))
        if shape == ref_shape:
            _assert_same_cache(cache, ref_cache, bs, f"{what}: KV cache")
    return worst, shape == ref_shape


def _rows(n: int, case: AttentionCase, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(n, case.num_heads, case.head_size, generator=gen)
    k = torch.randn(n, case.num_kv_heads, case.head_size, generator=gen)
    v = torch.randn(n, case.num_kv_heads, case.head_size, generator=gen)
    return q, k, v


def _steps(
    case: AttentionCase, block_ids: list[list[int]], device: torch.device
) -> dict[str, tuple[CommonAttentionMetadata, list[tuple[int, int, int]]]]:
    """Per step: the common metadata, and which (request, first position, count) rows it computes."""
    from pagedllm.worker.input_prep import prepare_inputs

    steps: dict[str, tuple[CommonAttentionMetadata, list[tuple[int, int, int]]]] = {}
    bs = case.block_size
    history = [i for i, c in enumerate(case.contexts) if c > 0]
    if history:
        # Requests of one token go first (the runner's decodes-first order), then the longer ones.
        order = sorted(history, key=lambda i: case.contexts[i] != 1)
        rows = [(i, 0, case.contexts[i]) for i in order]
        steps["step 1 (writing the cached contexts)"] = (_metadata(prepare_inputs, rows, block_ids, bs, device), rows)
    rows = [(i, c, q) for i, (c, q) in enumerate(zip(case.contexts, case.queries, strict=True))]
    steps["step 2 (the new tokens)"] = (_metadata(prepare_inputs, rows, block_ids, bs, device), rows)
    return steps


def _metadata(
    prepare_inputs: Any, rows: list[tuple[int, int, int]], block_ids: list[list[int]], bs: int, device: torch.device
) -> CommonAttentionMetadata:
    """The runner's own input preparation (so the metadata is exactly what the engine hands a backend)."""
    num_decodes = 0
    while num_decodes < len(rows) and rows[num_decodes][2] == 1:
        num_decodes += 1
    inputs = prepare_inputs(
        [list(range(start + count)) for _, start, count in rows],
        [start for _, start, _ in rows],
        [count for _, _, count in rows],
        [block_ids[i] for i, _, _ in rows],
        bs,
        device,
        num_decodes,
    )
    return inputs.attn  # type: ignore[no-any-return]


def _step_tensors(
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    rows: list[tuple[int, int, int]],
    case: AttentionCase,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's q/k/v rows; k and v as the model passes them: strided views into one fused projection row."""
    q = torch.cat([qkv[i][0][s : s + n] for i, s, n in rows]).to(device=device, dtype=dtype)
    k = torch.cat([qkv[i][1][s : s + n] for i, s, n in rows])
    v = torch.cat([qkv[i][2][s : s + n] for i, s, n in rows])
    tokens, width = k.shape[0], case.num_kv_heads * case.head_size
    fused = torch.zeros(tokens, 2 * width + 8)  # 8 spare columns: rows are not contiguous in k and v
    fused[:, :width] = k.reshape(tokens, width)
    fused[:, width : 2 * width] = v.reshape(tokens, width)
    fused = fused.to(device=device, dtype=dtype)
    shape = (tokens, case.num_kv_heads, case.head_size)
    return q, fused[:, :width].view(shape), fused[:, width : 2 * width].view(shape)


def _assert_same_cache(cache: torch.Tensor, ref_cache: torch.Tensor, block_size: int, what: str) -> None:
    if torch.equal(cache, ref_cache):
        return
    # Layout (2, blocks, block_size, ...) when it is the torch reference's: name the first wrong slot.
    differs = (cache != ref_cache).reshape(*cache.shape[:3], -1).any(-1).nonzero()
    first = differs[0].tolist() if differs.numel() else []
    where = (f"first at K/V {first[0]}, block {first[1]}, offset {first[2]} (slot {first[1] * block_size + first[2]})"
             if len(first) == 3 else "")
    raise AssertionError(f"{what} differs from the reference's in {len(differs)} rows, {where}")


def _describe(case: AttentionCase) -> str:
    fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(case) if f.name != "name"}
    return ", ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
