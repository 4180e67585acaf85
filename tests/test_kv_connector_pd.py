"""The `pd` KV connector in one process: a producer engine and a consumer engine (two LLMs), and transfers that
go wrong in every way the wire allows (truncated mid-payload, corrupt, stalled, another prompt's KV, no
server) -- each is a local prefill with the same tokens, never wrong KV. The two-process version with the
router is tests/test_disagg_serving.py.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_support import free_port  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.plugins.kv_connectors.pd.transport import TCPTransport  # noqa: E402
from pagedllm.plugins.kv_connectors.pd.wire import Reader, WireError, encode_message  # noqa: E402

BLOCK = 16
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 384) for _ in range(n)] for n in (9, 16, 33, 70, 129)]
HOST = "127.0.0.1"


def expected_cached(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def engines(tiny_root: Path) -> Iterator[dict[str, Any]]:
    model = make_tiny_model("llama", tiny_root)
    kv_port = free_port()
    common: dict[str, Any] = dict(block_size=BLOCK, num_threads=1, kv_transfer_config={"kv_connector": "pd"})
    producer = LLM(model, plugins={"pd": {"role": "kv_producer", "host": HOST, "port": kv_port}}, **common)
    # No prefix cache on the consumer: its reference runs leave nothing behind that could stand in for a
    # transfer, so every cached token below came over the wire.
    consumer = LLM(model, plugins={"pd": {"role": "kv_consumer", "transfer_timeout_s": 1.0}},
                   enable_prefix_caching=False, **common)
    yield {"producer": producer, "consumer": consumer, "kv_port": kv_port}
    producer.shutdown()
    consumer.shutdown()


def greedy(max_tokens: int = 8, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def prefill(engines: dict[str, Any], prompts: list[list[int]], tag: str) -> None:
    run(engines["producer"], prompts, [greedy(1, extra_args={"kv_transfer_params": {
        "do_remote_decode": True, "transfer_id": f"{tag}{i}"}}) for i in range(len(prompts))])


def decode_params(tag: str, n: int, port: int) -> list[SamplingParams]:
    return [greedy(extra_args={"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": f"{tag}{i}",
                                                      "remote_host": HOST, "remote_port": port}})
            for i in range(n)]


@pytest.fixture(scope="module")
def reference(engines: dict[str, Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in run(engines["consumer"], PROMPTS, [greedy()] * len(PROMPTS))]


def counters(llm: LLM) -> dict[str, int]:
    return dict(llm.get_stats().kv_connector)


def test_transferred_prompt_decodes_to_the_same_tokens(engines: dict[str, Any], reference: list[list[int]]) -> None:
    before = counters(engines["consumer"])
    prefill(engines, PROMPTS, "ok")
    assert counters(engines["producer"])["held_blocks"] == sum(map(expected_cached, PROMPTS)) // BLOCK
    outs = run(engines["consumer"], PROMPTS, decode_params("ok", len(PROMPTS), engines["kv_port"]))
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs] == [expected_cached(p) for p in PROMPTS]
    after = counters(engines["consumer"])
    assert after["remote_hit_tokens"] - before["remote_hit_tokens"] == sum(map(expected_cached, PROMPTS))
    assert after["transfer_failures"] == before["transfer_failures"]
    assert counters(engines["producer"])["held_blocks"] == 0  # each transfer is fetched once, then let go
    assert engines["producer"].engine.kv_cache_usage == 0.0 and engines["consumer"].engine.kv_cache_usage == 0.0


class FakeProducer:
    """A KV server that answers every fetch with `answer(real header, real payload)`'s bytes, then closes."""

    def __init__(self, header: dict[str, Any], payload: bytearray,
                 answer: Callable[[dict[str, Any], bytearray], bytes], stall: threading.Event | None = None) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.header, self.payload, self.answer, self.stall = header, payload, answer, stall
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                Reader(conn, None).message()
                conn.sendall(self.answer(self.header, self.payload))
                if self.stall is not None:
                    self.stall.wait(10)  # hold the connection open, sending nothing more

    def close(self) -> None:
        self.listener.close()


def _truncated(header: dict[str, Any], payload: bytearray) -> bytes:
    return encode_message(header) + bytes(payload[: len(payload) // 2])  # dies mid-payload


def _corrupt(header: dict[str, Any], payload: bytearray) -> bytes:
    flipped = bytearray(payload)
    flipped[len(flipped) // 3] ^= 0x40
    return encode_message(header) + bytes(flipped)


def _other_prompt(header: dict[str, Any], payload: bytearray) -> bytes:
    tokens = list(header["token_ids"])
    tokens[0] = tokens[0] % 300 + 1
    return encode_message({**header, "token_ids": tokens}) + bytes(payload)


def _other_layout(header: dict[str, Any], payload: bytearray) -> bytes:
    return encode_message({**header, "block_size": header["block_size"] * 2}) + bytes(payload)


@pytest.mark.parametrize("answer", [_truncated, _corrupt, _other_prompt, _other_layout, "stalled", "no server"])
def test_a_failed_transfer_is_a_local_prefill(engines: dict[str, Any], reference: list[list[int]],
                                              answer: Any) -> None:
    prompt, want = PROMPTS[3], reference[3]
    tag = f"bad-{getattr(answer, '__name__', answer)}-"
    prefill(engines, [prompt], tag)
    # The real frame, fetched from the real producer, then replayed broken by a fake one.
    header, payload = TCPTransport().fetch(HOST, engines["kv_port"], f"{tag}0", 5.0)
    stall = threading.Event() if answer == "stalled" else None
    fake = None
    if answer == "no server":
        port = free_port()
    else:
        fake = FakeProducer(header, payload, _truncated if stall else answer, stall)
        port = fake.port
    before = counters(engines["consumer"])
    try:
        out = run(engines["consumer"], [prompt], decode_params(tag, 1, port))[0]
    finally:
        if stall is not None:
            stall.set()
        if fake is not None:
            fake.close()
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == 0  # computed here, nothing taken from the broken transfer
    after = counters(engines["consumer"])
    assert after["transfer_failures"] == before["transfer_failures"] + 1
    assert after["remote_hit_tokens"] == before["remote_hit_tokens"]
    assert engines["consumer"].engine.kv_cache_usage == 0.0


def test_the_wire_refuses_what_is_not_a_frame() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
        with pytest.raises(WireError, match="not a KV transfer frame"):
            Reader(b, None).message()
    with pytest.raises(WireError, match="no KV for transfer"):
        _fetch_unknown()


def _fetch_unknown() -> None:
    transport = TCPTransport(HOST, 0)
    host, port = transport.serve(lambda _tid: None)
    try:
        transport.fetch(host, port, "never-held", 5.0)
    finally:
        transport.close()


def test_bad_options_name_the_key(tiny_root: Path) -> None:
    model = make_tiny_model("llama", tiny_root)
    with pytest.raises(Exception, match="plugins.pd.role"):
        LLM(model, kv_transfer_config={"kv_connector": "pd"}, plugins={"pd": {"role": "prefill"}})


def test_kv_both_serves_and_fetches_its_own_transfer(tiny_root: Path, reference: list[list[int]]) -> None:
    """`kv_both`: one engine is producer and consumer (no prefix cache, so the second pass must fetch)."""
    model = make_tiny_model("llama", tiny_root)
    port = free_port()
    llm = LLM(model, block_size=BLOCK, num_threads=1, enable_prefix_caching=False,
              kv_transfer_config={"kv_connector": "pd"}, plugins={"pd": {"role": "kv_both", "port": port}})
    try:
        prompts = PROMPTS[2:]
        run(llm, prompts, [greedy(1, extra_args={"kv_transfer_params": {
            "do_remote_decode": True, "transfer_id": f"both{i}"}}) for i in range(len(prompts))])
        outs = run(llm, prompts, decode_params("both", len(prompts), port))
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == reference[2:]
    assert [o.num_cached_tokens for o in outs] == [expected_cached(p) for p in prompts]
