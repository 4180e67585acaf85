"""One request builder (engine/input_processing.py) behind both frontends, and runners built whole.

The model here lists two EOS ids (generation_config.json: [9, 2]) and its tokenizer's eos is 2. The two
frontends used to pick the primary EOS out of that set each their own way -- LLMEngine an arbitrary set
element (9 here), AsyncLLM the smallest (2) -- where vLLM takes the tokenizer's (input_processing.py NOTE 1).
The same prompt and params through LLMEngine and through AsyncLLM (its real messages, round-tripped through
their encoding, into the engine core the server's core process builds) must become identical engine-core
requests and identical outputs.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tiny_models import make_tiny_model

from pagedllm import SamplingParams, hookimpl
from pagedllm.config import EngineConfig
from pagedllm.engine import async_llm, core_proc
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.builder import build_engine
from pagedllm.engine.input_processing import RequestValidationError, eos_token_ids
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.serialization import (
    AddRequest,
    Outputs,
    Ready,
    decode_from_core,
    decode_to_core,
    encode,
    make_add_request,
    request_from_message,
)
from pagedllm.plugin_manager import PluginManager
from pagedllm.protocols.loader import LoadedModelInfo
from pagedllm.request import Request

MAX_MODEL_LEN = 64
CASES: list[tuple[Any, SamplingParams]] = [
    ("w5 w6 w7 w8", SamplingParams(temperature=0.0, max_tokens=8)),
    ({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=None)),
    ({"prompt": "w12 w40"}, SamplingParams(n=2, seed=3, temperature=0.8, max_tokens=6, stop_token_ids=[11])),
    ([30, 31, 32, 33], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)),
]


@pytest.fixture(scope="module")
def two_eos_model(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with a word-level tokenizer (eos `</s>` = 2) and generation_config eos ids [9, 2]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("two_eos") / "llama"
    shutil.copytree(make_tiny_model("llama", tiny_root), path)
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["eos_token_id"] = [9, 2]
    gen_path.write_text(json.dumps(gen))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 384)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", unk_token="<unk>") \
        .save_pretrained(str(path))
    return str(path)


class _Added:
    def __init__(self) -> None:
        self.requests: list[Request] = []

    @hookimpl
    def request_added(self, request: Any) -> None:
        self.requests.append(request)


class _InProcessClient:
    """EngineCoreClient without the process: the frontend's messages, encoded and decoded as on the socket,
    into the EngineCore (and Ready) that the engine-core process builds (core_proc._build)."""

    def __init__(self, config: EngineConfig, on_outputs: Callable[[Outputs], None], on_death: Any) -> None:
        core, ready = core_proc._build(config.model_dump())
        self.core = core
        self.ready = decode_from_core(encode(ready))
        self.on_outputs = on_outputs
        self.dead_reason: str | None = None
        self.alive = True
        self._closed = False
        self.sent: list[AddRequest] = []

    async def start(self) -> Ready:
        assert isinstance(self.ready, Ready)
        return self.ready

    def add_request(self, request: Request) -> None:
        msg = decode_to_core(encode(make_add_request(request)))
        assert isinstance(msg, AddRequest)
        self.sent.append(msg)
        self.core.add_request(request_from_message(msg))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(list(request_ids))

    def step(self) -> None:
        msg = decode_from_core(encode(Outputs(self.core.step(), self.core.get_stats(), time.time())))
        assert isinstance(msg, Outputs)
        self.on_outputs(msg)

    async def shutdown(self) -> None:
        self._closed = True
        self.core.shutdown()


def _message(request: Request) -> AddRequest:
    """What the core receives for `request`, arrival time aside (another process's clock)."""
    return msgspec.structs.replace(make_add_request(request), arrival_time=0.0)


def _offline(model: str) -> tuple[list[AddRequest], dict[str, list[tuple[Any, ...]]]]:
    pm, added = PluginManager(), _Added()
    pm.register(added, name="added", distribution="tests")
    engine = LLMEngine(EngineConfig(model=model, num_threads=1, max_model_len=MAX_MODEL_LEN), plugin_manager=pm)
    try:
        assert engine.requests.limits.eos_token_id == 2 and engine.eos_token_ids == {2, 9}
        for i, (prompt, params) in enumerate(CASES):
            engine.add_request(f"r{i}", prompt, params)
        finals: dict[str, list[tuple[Any, ...]]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = [
                        (c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason) for c in out.outputs
                    ]
    finally:
        engine.shutdown()
    return [_message(r) for r in added.requests], finals


def _served(model: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[AddRequest], dict[str, list[tuple[Any, ...]]]]:
    monkeypatch.setattr(async_llm, "EngineCoreClient", _InProcessClient)
    llm = AsyncLLM(EngineConfig(model=model, num_threads=1, max_model_len=MAX_MODEL_LEN), plugin_manager=PluginManager())
    client = llm.client
    assert isinstance(client, _InProcessClient)

    async def run() -> dict[str, list[tuple[Any, ...]]]:
        await llm.start()
        streams = [llm.add_request(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(CASES)]
        while not all(s.finished for s in streams):
            client.step()
        finals: dict[str, list[tuple[Any, ...]]] = {}
        for stream in streams:
            joined: dict[int, list[Any]] = {}
            while (delta := stream.output.get_nowait()) is not None:
                assert not isinstance(delta, BaseException)
                for c in delta.outputs:  # deltas: concatenate text and ids, keep the last finish
                    entry = joined.setdefault(c.index, [c.index, "", [], None, None])
                    entry[1] += c.text
                    entry[2] += list(c.token_ids)
                    entry[3], entry[4] = c.finish_reason, c.stop_reason
            finals[stream.request_id] = [tuple(joined[i]) for i in sorted(joined)]
        await llm.shutdown()
        return finals

    finals = asyncio.run(run())
    return [msgspec.structs.replace(m, arrival_time=0.0) for m in client.sent], finals


def test_both_frontends_build_the_same_requests_and_outputs(two_eos_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_msgs, offline_out = _offline(two_eos_model)
    served_msgs, served_out = _served(two_eos_model, monkeypatch)
    # vLLM's EOS rules: the tokenizer's eos is the primary one; the model's listed ids also stop (not with
    # ignore_eos); explicit stop ids join them.
    assert [m.eos_token_id for m in offline_msgs] == [2] * 5
    assert [m.params["all_stop_token_ids"] for m in offline_msgs] == [[2, 9], [2, 9], [2, 9, 11], [2, 9, 11], []]
    assert [m.request_id for m in offline_msgs] == ["r0", "r1", "r2#0", "r2#1", "r3"]
    assert offline_msgs[1].params["max_tokens"] == MAX_MODEL_LEN - 3  # None: the rest of the context
    assert served_msgs == offline_msgs
    assert served_out == offline_out
    assert offline_out["r2"][0][0] == 0 and len(offline_out["r2"]) == 2


def test_primary_eos_without_a_tokenizer_is_the_models_first() -> None:
    info = LoadedModelInfo(hf_config=None, tokenizer=None, eos_token_ids=[9, 2])
    assert eos_token_ids(info) == (9, [2, 9])
    assert eos_token_ids(LoadedModelInfo(hf_config=None, tokenizer=None)) == (None, [])


def test_a_request_id_in_use_is_refused_by_both_policies(tiny_root: Path) -> None:
    engine = LLMEngine(EngineConfig(model=make_tiny_model("llama", tiny_root), num_threads=1), PluginManager())
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(RequestValidationError, match="'a' is already in use") as info:
            engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
        assert info.value.param == "request_id"
        # The offline policy: a prompt too long for the context is accepted and fails alone.
        engine.add_request("long", [5] * 600, SamplingParams(max_tokens=2))
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert finished["long"].outputs[0].finish_reason == "error"
        assert finished["a"].outputs[0].finish_reason in ("stop", "length")
    finally:
        engine.shutdown()


def test_the_runner_is_built_with_its_plugins(tiny_root: Path) -> None:
    """build_engine alone (no EngineCore) gives a runner with its speculator and the sampler's processors."""
    config = EngineConfig.from_dict({}, {"model": make_tiny_model("qwen3", tiny_root), "num_threads": 1,
                                         "speculative.method": "ngram", "speculative.num_speculative_tokens": 2})
    parts = build_engine(config, PluginManager())
    try:
        assert parts.runner.speculator is not None and parts.runner.speculator.num_speculative_tokens == 2
        assert parts.selections["proposer"].winner.name == "ngram"
        # (then, on a GPU, compile-ahead, graph capture and warm-up)
        assert list(parts.startup_phases)[:3] == ["model and weights", "KV cache sizing and allocation",
                                                  "speculative proposer"]
        assert parts.runner.sampler.logits_processors == () and parts.logits_processors == []
    finally:
        parts.executor.shutdown()
        parts.runner.release()
