"""What the grammar manager keeps once its requests have finished: nothing of theirs. Every matcher made for
a request is freed when the request ends, also for the requests that arrived while their grammar compiled (the
cached compilation's future must not hold them), and the per-request maps are empty again -- repeat after
repeat of the same workload, so that no per-request state accumulates (issue 25)."""

from __future__ import annotations

import gc
import json
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

from structured_models import tiny_model_with_tokenizer  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402

ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "kind": {"enum": ["a", "b", "c"]}},
        "required": ["id", "kind"], "additionalProperties": False}
PROMPTS = [f"Item {i} as JSON:" for i in range(12)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    model = tiny_model_with_tokenizer(tmp_path_factory.mktemp("structured_state"))
    engine = LLM(model, block_size=4, async_scheduling=True,
                 structured_outputs_config={"disable_any_whitespace": True})
    yield engine
    engine.engine.shutdown()


def test_finished_requests_leave_no_matchers_and_no_state(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.plugins.structured_output.xgrammar import backend as xg

    made: list[weakref.ref[Any]] = []
    make_grammar = xg.XgrammarBackend.make_grammar

    def recorded(self: Any, compiled: Any) -> Any:
        grammar = make_grammar(self, compiled)
        made.append(weakref.ref(grammar))
        return grammar

    # The compile waits until every request is queued, so all of them wait for it (the case that leaked).
    queued = threading.Event()
    compile_grammar = xg.XgrammarBackend.compile

    def slow_compile(self: Any, params: Any) -> Any:
        queued.wait(5)
        return compile_grammar(self, params)

    monkeypatch.setattr(xg.XgrammarBackend, "make_grammar", recorded)
    monkeypatch.setattr(xg.XgrammarBackend, "compile", slow_compile)
    core = llm.engine.core
    add_request = core.add_request
    added = [0]

    def add(request: Any) -> None:
        add_request(request)
        added[0] += 1
        if added[0] == len(PROMPTS):
            queued.set()

    monkeypatch.setattr(core, "add_request", add)
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=ITEM, backend="xgrammar"))
    manager = None
    for repeat in range(3):
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        for out in outputs:
            jsonschema.validate(json.loads(out.outputs[0].text), ITEM)
        manager = core.structured_outputs
        assert not manager.grammars and not manager._pre_accepted and not core._awaiting_grammar
        assert len(made) == len(PROMPTS) * (repeat + 1)
        gc.collect()
        alive = sum(ref() is not None for ref in made)
        assert alive == 0, f"repeat {repeat}: {alive} of {len(made)} matchers still alive"
