"""Issue 26, the pieces on their own: disconnect watching (nested, as the route and the collector both watch),
the concurrent start of a batched request, and the admission limits' arithmetic."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("fastapi")

from pagedllm.engine.admission import AdmissionLimits, default_max_waiting, resolve_max_waiting  # noqa: E402
from pagedllm.plugins.server.errors import APIError  # noqa: E402
from pagedllm.plugins.server.serving_common import start_streams, until_disconnected  # noqa: E402


class _Client:
    """The one Request method until_disconnected calls; the client 'leaves' at a set time."""

    def __init__(self, leaves_after_s: float) -> None:
        self.leaves_at = asyncio.get_running_loop().time() + leaves_after_s

    async def is_disconnected(self) -> bool:
        return asyncio.get_running_loop().time() >= self.leaves_at


def test_nested_watchers_cancel_the_inner_work() -> None:
    """The route watches the whole request and the collector watches its part: whichever sees the client
    leave first, the work underneath is cancelled (before: the outer watcher cancelled only the inner watcher,
    and the work ran on to the end)."""

    async def run() -> bool:
        cancelled = asyncio.Event()

        async def work() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        client = _Client(leaves_after_s=0.2)
        with pytest.raises((APIError, asyncio.CancelledError)):
            await until_disconnected(client, lambda: until_disconnected(client, work))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        return cancelled.is_set()

    assert asyncio.run(run())


def test_start_streams_starts_every_generator_at_once() -> None:
    """Each generator's first item is awaited concurrently: 8 that each take 0.2 s to their first output take
    about 0.2 s together (one after another they took 1.6 s); a failing one closes the others."""

    async def gen(i: int, log: list[str], fail: bool = False) -> AsyncIterator[int]:
        try:
            log.append(f"start {i}")
            await asyncio.sleep(0.2)
            if fail:
                raise ValueError("bad prompt")
            yield i
            await asyncio.sleep(60)
            yield -1
        finally:
            log.append(f"closed {i}")

    async def run() -> tuple[float, list[str], list[str]]:
        log: list[str] = []
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        firsts = await start_streams([gen(i, log) for i in range(8)])  # type: ignore[misc]
        took = loop.time() - t0
        assert firsts == list(range(8))
        failing: list[str] = []
        with pytest.raises(ValueError):
            await start_streams([gen(0, failing), gen(1, failing, fail=True), gen(2, failing)])  # type: ignore[misc]
        return took, log, failing

    took, log, failing = asyncio.run(run())
    assert took < 0.8, took
    assert log[:8] == [f"start {i}" for i in range(8)]
    assert sorted(failing) == sorted(["start 0", "start 1", "start 2", "closed 0", "closed 1", "closed 2"])


def test_default_waiting_bound_comes_from_the_kv_cache() -> None:
    # 1000 blocks x 16 tokens hold 16 sequences of 1,000 tokens: more than one batch of 8.
    assert default_max_waiting(max_num_seqs=8, num_blocks=1000, block_size=16, max_model_len=1000) == 16
    # A cache smaller than one batch of full-length sequences still lets one batch wait.
    assert default_max_waiting(max_num_seqs=8, num_blocks=10, block_size=16, max_model_len=1000) == 8
    kv = dict(max_num_seqs=8, num_blocks=1000, block_size=16, max_model_len=1000)
    assert resolve_max_waiting(AdmissionLimits(), None, **kv) == 16
    assert resolve_max_waiting(AdmissionLimits(), 3, **kv) == 3  # scheduler.max_waiting
    assert resolve_max_waiting(AdmissionLimits(max_waiting=0), 3, **kv) is None  # --max-waiting 0: unbounded
    assert resolve_max_waiting(AdmissionLimits(max_waiting=5), 3, **kv) == 5


@pytest.mark.parametrize("kw", [{"max_waiting": -1}, {"max_tokens": 0}, {"request_timeout_s": 0.0}])
def test_admission_limits_reject_nonsense(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw)).split("_s")[0].replace("_", " ").split(" ")[0]):
        AdmissionLimits(**kw)  # type: ignore[arg-type]
