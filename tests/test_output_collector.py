"""OutputCollector: deltas a slow consumer has not taken merge into one; their concatenation never changes."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.engine.output_collector import OutputCollector, merge_delta
from pagedllm.outputs import CompletionOutput, RequestOutput


def _delta(samples: list[tuple[int, str, list[int], str | None]], finished: bool = False,
           cached: int = 0) -> RequestOutput:
    outs = [CompletionOutput(i, text, ids, None, None, finish, None) for i, text, ids, finish in samples]
    return RequestOutput("r", "p", [1, 2], outs, finished, num_cached_tokens=cached)


def test_one_delta_passes_through_unchanged() -> None:
    async def run() -> None:
        c = OutputCollector()
        d = _delta([(0, "a", [5], None)])
        c.put(d)
        assert await c.get() is d
        assert c.get_nowait() is None

    asyncio.run(run())


def test_pending_deltas_merge_per_sample_in_order() -> None:
    c = OutputCollector()
    c.put(_delta([(0, "He", [1], None), (1, "A", [9], None)]))
    c.put(_delta([(1, "B", [8], None)], cached=16))
    c.put(_delta([(0, "llo", [2, 3], "length"), (1, "", [], "stop")], finished=True, cached=16))
    merged = c.get_nowait()
    assert isinstance(merged, RequestOutput)
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in merged.outputs] == [
        (0, "Hello", [1, 2, 3], "length"), (1, "AB", [9, 8], "stop")]
    assert merged.finished and merged.num_cached_tokens == 16
    assert c.get_nowait() is None  # taken


def test_sample_first_seen_in_a_later_delta_is_added_in_index_order() -> None:
    into = _delta([(1, "x", [4], None)])
    merge_delta(into, _delta([(0, "y", [5], None)]))
    assert [(o.index, o.text) for o in into.outputs] == [(0, "y"), (1, "x")]


def test_merge_does_not_touch_the_first_deltas_id_list() -> None:
    ids = [1]
    into = _delta([(0, "a", ids, None)])
    merge_delta(into, _delta([(0, "b", [2], None)]))
    assert ids == [1] and into.outputs[0].token_ids == [1, 2]


def test_logprobs_are_extended() -> None:
    into = _delta([(0, "a", [1], None)])
    into.outputs[0].logprobs = [{1: "lp1"}]  # type: ignore[dict-item]
    later = _delta([(0, "b", [2], None)])
    later.outputs[0].logprobs = [{2: "lp2"}]  # type: ignore[dict-item]
    later.outputs[0].cumulative_logprob = -1.5
    merge_delta(into, later)
    assert into.outputs[0].logprobs == [{1: "lp1"}, {2: "lp2"}]
    assert into.outputs[0].cumulative_logprob == -1.5


def test_an_error_replaces_what_is_pending_and_stays() -> None:
    c = OutputCollector()
    c.put(_delta([(0, "a", [1], None)]))
    err = RuntimeError("engine died")
    c.put(err)
    c.put(_delta([(0, "b", [2], None)]))  # after the error: dropped, the error is the last word
    assert c.get_nowait() is err


def test_get_waits_for_a_put() -> None:
    async def run() -> RequestOutput | BaseException:
        c = OutputCollector()
        waiter = asyncio.create_task(c.get())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        asyncio.get_running_loop().call_later(0.01, c.put, _delta([(0, "z", [7], "stop")], finished=True))
        return await asyncio.wait_for(waiter, timeout=5)

    out = asyncio.run(run())
    assert isinstance(out, RequestOutput) and out.outputs[0].text == "z"


@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_concatenation_is_independent_of_how_deltas_were_grouped(split: int) -> None:
    """Taking after every `split` puts gives the same text and ids as taking after each one."""
    pieces = [(f"tok{i} ", [i]) for i in range(12)]
    c = OutputCollector()
    text, ids = "", []
    for k, (t, i) in enumerate(pieces):
        last = k == len(pieces) - 1
        c.put(_delta([(0, t, i, "length" if last else None)], finished=last))
        if (k + 1) % split == 0 or last:
            got = c.get_nowait()
            assert isinstance(got, RequestOutput)
            text += got.outputs[0].text
            ids += got.outputs[0].token_ids
    assert text == "".join(t for t, _ in pieces) and ids == list(range(12))
