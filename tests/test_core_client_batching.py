"""The client's wire messages (core_client.py NOTE 2): what is added in one event-loop turn reaches the core
as one AddRequests message, so the prompts of one API request enter the same step; an abort sent in the same
turn follows its adds, never overtakes them; a core that is not connected fails the adds (on_death), never
drops them. A PULL socket stands in for the engine-core process."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")

from pagedllm.config import EngineConfig  # noqa: E402
from pagedllm.engine.core_client import EngineCoreClient  # noqa: E402
from pagedllm.engine.serialization import Abort, AddRequest, AddRequests, decode_to_core  # noqa: E402
from pagedllm.request import Request  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture
def client() -> Iterator[tuple[EngineCoreClient, list[str]]]:
    deaths: list[str] = []
    c = EngineCoreClient(EngineConfig(model="unused"), on_outputs=lambda _: None, on_death=deaths.append)
    c._reader = object()  # type: ignore[assignment]  # "ready": add_request refuses a starting core
    yield c, deaths
    # destroy, not term: a test that fails while its peer socket is open must not hang the run in term()
    c._sync_ctx.destroy(linger=0)
    c._async_ctx.destroy(linger=0)


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4))


def _received(peer: Any) -> list[Any]:
    out = []
    while peer.poll(500):
        out.append(decode_to_core(peer.recv()))
    return out


def test_one_turn_is_one_message_and_an_abort_follows_its_adds(client: tuple[EngineCoreClient, list[str]]) -> None:
    c, deaths = client
    peer = c._sync_ctx.socket(zmq.PULL)
    peer.connect(c.input_addr)
    # connect is asynchronous: on a loaded machine the first add could find no peer yet (and fail, as the
    # other test wants); a PUSH socket polls writable once a peer is attached
    assert c._push.poll(10_000, zmq.POLLOUT), "the peer never connected"

    async def run() -> None:
        for i in range(8):
            c.add_request(_request(f"a{i}"))
        await asyncio.sleep(0.01)  # the turn ends: the eight leave together
        c.add_request(_request("b0"))
        c.add_request(_request("b1"))
        c.abort(["b1"])  # same turn as its add: the add must be sent first
        await asyncio.sleep(0.01)
        c.add_request(_request("c0"))

    asyncio.run(run())
    msgs = _received(peer)
    peer.close(linger=0)
    assert isinstance(msgs[0], AddRequests) and [m.request_id for m in msgs[0].requests] == [f"a{i}" for i in range(8)]
    assert isinstance(msgs[1], AddRequests) and [m.request_id for m in msgs[1].requests] == ["b0", "b1"]
    assert isinstance(msgs[2], Abort) and msgs[2].request_ids == ["b1"]
    assert isinstance(msgs[3], AddRequest) and msgs[3].request_id == "c0"  # alone in its turn: plain message
    assert len(msgs) == 4 and deaths == []


def test_adds_with_no_core_connected_are_failed_not_dropped(client: tuple[EngineCoreClient, list[str]]) -> None:
    c, deaths = client

    async def run() -> None:
        c.add_request(_request("x"))
        await asyncio.sleep(0.01)

    asyncio.run(run())
    assert c.dead_reason is not None and deaths == [c.dead_reason]
