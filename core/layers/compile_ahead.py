"""Compile-ahead: every Triton binary a start-up will launch, built in parallel before it launches any.

A cold start compiled its Triton kernels one after another where they were first launched -- the profiling
step, each captured graph size, each warm-up kind -- ~25 binaries, 15-20 s of a 30-40 s start on the H200
(docs/perf-notes.md §19). Triton builds a binary per specialisation (constexprs, launch options, which
pointers and integers are 16-divisible), so only a launch with the real arguments names the binary the real
launch will want. Inside `compiling_ahead()` the launch sites that go through `launch()` ask Triton for that
binary without running it (Triton's `warmup`: the same specialisation as the launch) and Triton's
AsyncCompileMode builds them on a thread pool (its MLIR passes and ptxas run outside the GIL); leaving the
block waits for all of them. The model runner walks its warm-up kinds and graph sizes that way first
(ModelRunner.compile_ahead), then captures and warms up with every binary already in Triton's cache.

In that pass nothing a `launch()` names runs: its outputs hold whatever memory they were given, the KV cache
is not written, and torch's own ops compute on that garbage -- harmless, as no value is read back. A kernel
launched another way (kernel[grid](...) directly) runs as usual there: it compiles in the calling thread.
Light module: triton is imported only when compiling ahead.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

logger = logging.getLogger(__name__)

_COMPILE_ONLY: ContextVar[bool] = ContextVar("pagedllm_compile_only", default=False)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`; inside compiling_ahead(), only its compile (nothing runs)."""
    if _COMPILE_ONLY.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def available() -> bool:
    """Whether this Triton can compile on a thread pool (AsyncCompileMode: Triton >= 3.4)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def compiling_ahead(workers: int | None = None) -> Iterator[None]:
    """Launches through `launch()` only compile, on `workers` threads (default: the CPUs this process may
    use); leaving the block waits for every compile and raises the first that failed."""
    from triton.runtime._async_compile import AsyncCompileMode

    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 4
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="triton-compile") as pool:
        token = _COMPILE_ONLY.set(True)
        try:
            with AsyncCompileMode(pool) as mode:
                yield
        finally:
            _COMPILE_ONLY.reset(token)
        _build_launchers(pool, [future.kernel for future in mode.future_kernels.values()])


def _build_launchers(pool: ThreadPoolExecutor, kernels: list[Any]) -> None:
    """Build the host launcher of each compiled kernel on the pool, so the first real launches find them built.

    NOTE: Triton compiles a small C launcher per kernel signature (a C compiler subprocess, 0.1-0.4 s each) only
    when a binary is first launched, i.e. serially in the thread that launches: on a cold H200 start 10 of them
    took 3.6 s of the profiling step and the graph captures. Constructing the launcher here (host-only work,
    no CUDA call) leaves the built module in Triton's cache, where the first launch then loads it. Best effort:
    a failure only means that launch builds its own.
    """
    try:
        from triton.runtime.driver import driver

        launcher_cls = driver.active.launcher_cls
    except Exception:  # noqa: BLE001 - another Triton layout: launches build their launchers as before
        return

    def build(kernel: Any) -> None:
        launcher_cls(kernel.src, kernel.metadata)

    futures = [pool.submit(build, k) for k in kernels if k is not None and getattr(k, "module", 1) is None]
    for future in futures:
        try:
            future.result()
        except Exception:  # noqa: BLE001 - see the NOTE: the launch builds it
            logger.debug("building a Triton launcher ahead failed", exc_info=True)


@contextmanager
def repeated_layers_skipped(model: Any) -> Iterator[None]:
    """Inside: a layer of one of `model`'s layer lists (torch ModuleLists) whose call repeats an earlier layer's
    call returns that call's output instead of running. For compile-ahead walks only (nothing they compute is
    read), where a 32-layer stack otherwise walked 32 identical layers per step size: ~4 s of Python per start
    on the H200, most of the compile-ahead phase even with every binary cached.

    NOTE: a repeat is the same layer class, the same parameter and buffer shapes, dtypes and strides, the same
    numeric settings on the layer, its submodules and the plain objects they hold (a window, a soft-cap, a
    scale: what picks a kernel's constants), the same tensor argument shapes and the very same non-tensor
    arguments (one step's metadata): then its launches name the same Triton binaries. Strings (layer names)
    and a layer's index (`layer_idx`: models turn it into settings such as a window when they build) are left
    out. A setting this misses makes a layer look new, never the same, and a kernel it wrongly skipped
    would only compile at its first real launch: the walk never changes what a real step computes.
    """
    layers = [m for lst in model.modules() if type(lst).__name__ == "ModuleList" and len(lst) > 1 for m in lst]
    seen: dict[tuple[Any, ...], tuple[Any, list[Any]]] = {}  # call key -> (output, the arguments kept alive)
    signatures: dict[int, tuple[Any, ...]] = {}

    def wrap(layer: Any) -> Callable[..., Any]:
        forward = layer.forward

        def skipping_forward(*args: Any, **kwargs: Any) -> Any:
            if not _COMPILE_ONLY.get():
                return forward(*args, **kwargs)
            if id(layer) not in signatures:
                signatures[id(layer)] = _layer_signature(layer)
            key = (signatures[id(layer)], *(_arg_key(a) for a in args),
                   *((k, _arg_key(v)) for k, v in sorted(kwargs.items())))
            hit = seen.get(key)
            if hit is not None:
                return hit[0]
            out = forward(*args, **kwargs)
            # The arguments stay referenced so no id() in a key is reused by a later step's objects.
            seen[key] = (out, [args, kwargs])
            return out

        return skipping_forward

    for layer in layers:
        layer.forward = wrap(layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
        seen.clear()


_POSITION_NAMES = ("layer_idx", "layer_id", "layer_index", "idx")  # where a layer sits, not how it computes


def _scalars(obj: Any) -> tuple[Any, ...]:
    return tuple((k, v) for k, v in sorted(vars(obj).items())
                 if isinstance(v, (bool, int, float, type(None))) and not k.startswith("_") and k not in _POSITION_NAMES)


def _layer_signature(layer: Any) -> tuple[Any, ...]:
    import torch

    parts: list[Any] = []
    for name, t in itertools.chain(layer.named_parameters(), layer.named_buffers()):
        parts.append((name, tuple(t.shape), str(t.dtype), t.stride()))
    for name, sub in layer.named_modules():
        parts.append((name, type(sub).__qualname__, _scalars(sub)))
        for attr, value in sorted(vars(sub).items()):  # plain objects held (an attention impl, its config)
            if attr.startswith("_") or isinstance(value, (torch.Tensor, torch.nn.Module, str, bytes, list, tuple, dict)):
                continue
            if hasattr(value, "__dict__") and not callable(value):
                parts.append((name, attr, type(value).__qualname__, _scalars(value)))
    return tuple(parts)


def _arg_key(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.stride(), str(value.device))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_arg_key(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    return ("object", id(value))


def compile_first(fn: Callable[[], object]) -> None:
    """Call `fn` once inside compiling_ahead() where this Triton can, so that the real call after it finds its
    binaries built in parallel. A failure is logged, not raised: the real call compiles what is missing."""
    if not available():
        return
    try:
        with compiling_ahead():
            fn()
    except Exception:  # noqa: BLE001 - an optimisation; the real call reports a real error
        logger.warning("compiling Triton kernels ahead failed; they compile on first use", exc_info=True)
