"""Pipelined grammar steps with the grammar work on the manager's worker thread (structured_output/manager.py
NOTE 4): the same tokens as the synchronous engine, output valid against `jsonschema`, and the order of events
that makes it overlap -- a step's ids accepted while the engine thread schedules the next step, that step's
mask applied only after its forward was launched and the worker joined."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

from structured_models import tiny_model_with_tokenizer  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.bitmask import GrammarBitmask  # noqa: E402

# Lengths bounded by patterns: xgrammar serves them (a maxLength would send the request to llguidance).
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
TAGS = {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9]{1,3}$"}, "minItems": 2, "maxItems": 4}
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[a-z]{2,4}-[0-9]{2}"
CONFIG = {"disable_any_whitespace": True}


def _so(max_tokens: int = 120, **constraint: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**constraint))


# A mixed batch: free requests (one finishing after 3 tokens), a choice that terminates within a few tokens, JSON
# that terminates, JSON cut by max_tokens in the middle of its grammar, a regex.
PROMPTS = ["Free text here", "Short one", "Pick:", "Describe a user as JSON:", "x", "{", "Code:"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=0.0, max_tokens=3),
          _so(choice=CHOICES), _so(json=PERSON), _so(json=TAGS), _so(max_tokens=6, json=PERSON), _so(regex=REGEX)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("structured_pipelined"))


@pytest.fixture(scope="module")
def pipelined_llm(model_dir: str) -> Iterator[LLM]:
    llm = LLM(model_dir, block_size=4, async_scheduling=True, structured_outputs_config=CONFIG)
    core = llm.engine.core
    assert core.async_scheduling and core._pipelined_grammars
    yield llm
    llm.engine.shutdown()


def _synchronous(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    """The reference: the same engine (weights, compiled grammars) with async scheduling off, every step
    synchronous, masks filled by the engine core before the forward (engine_core.py NOTE 2)."""
    core = llm.engine.core
    core.async_scheduling = False
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.async_scheduling = True


def _ids(outputs: list[Any]) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def _reasons(outputs: list[Any]) -> list[str | None]:
    return [c.finish_reason for o in outputs for c in o.outputs]


def _record_worker_tasks(manager: Any) -> list[set[str]]:
    """From now on, the grammar classes of each task the worker runs (manager.py NOTE 4)."""
    tasks: list[set[str]] = []
    original = type(manager)._accept_and_fill

    def recorded(req_ids: list[str], picks: list[Any], fetch: Any) -> Any:
        tasks.append({type(grammar).__name__ for _, _, grammar in picks})
        return original(manager, req_ids, picks, fetch)

    manager._accept_and_fill = recorded
    return tasks


def test_mixed_batch_same_tokens_as_the_synchronous_engine(pipelined_llm: LLM) -> None:
    expected = _synchronous(pipelined_llm, PROMPTS, PARAMS)
    core = pipelined_llm.engine.core
    manager = core.structured_outputs
    tasks = _record_worker_tasks(manager)
    interval = sys.getswitchinterval()
    got = pipelined_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    del manager._accept_and_fill
    assert len(tasks) > 10  # the ids went to the grammars on the worker, step after step
    assert _ids(got) == _ids(expected)
    assert _reasons(got) == _reasons(expected)
    assert _reasons(got)[:2] == ["length", "length"] and len(got[1].outputs[0].token_ids) == 3
    assert got[2].outputs[0].text in CHOICES and got[2].outputs[0].finish_reason == "stop"
    for out, schema in ((got[3], PERSON), (got[4], TAGS)):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert got[5].outputs[0].finish_reason == "length" and got[5].outputs[0].text.startswith('{"')
    assert re.fullmatch(REGEX, got[6].outputs[0].text)
    # Nothing left behind: no grammar, no recorded acceptance, and once the worker is idle (generate() returns
    # with the last step's task perhaps still running) the interpreter's switch interval as it was.
    assert not manager.grammars and not manager._pre_accepted
    deadline = time.monotonic() + 2.0
    while sys.getswitchinterval() != interval and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sys.getswitchinterval() == interval


def test_a_backend_without_gil_free_batches_resolves_on_the_runner(pipelined_llm: LLM) -> None:
    """llguidance's grammars declare no GIL-free batch calls: in a step beside xgrammar's, its tokens are
    accepted on the engine thread (NOTE 3's path) and the others' on the worker, with the same tokens."""
    params = [*PARAMS[:4], _so(json=TAGS, backend="llguidance")]
    expected = _synchronous(pipelined_llm, PROMPTS[:5], params)
    manager = pipelined_llm.engine.core.structured_outputs
    tasks = _record_worker_tasks(manager)
    got = pipelined_llm.generate(PROMPTS[:5], params, use_tqdm=False)
    del manager._accept_and_fill
    assert _ids(got) == _ids(expected) and _reasons(got) == _reasons(expected)
    jsonschema.validate(json.loads(got[4].outputs[0].text), TAGS)
    assert tasks and all(names == {"XgrammarGrammar"} for names in tasks), tasks


def test_grammar_work_overlaps_scheduling_and_precedes_the_mask(pipelined_llm: LLM) -> None:
    """The event log of a pipelined run. The worker's task waits (up to 1.5 s) for the engine thread to
    schedule a step after the task was handed over: that only happens when the task runs beside the engine's
    host work, not in series with it. Each mask is applied after its step's forward was launched, after the
    step after it was scheduled (the runner samples a masked step at its next call) and after the worker that
    filled it finished."""
    core = pipelined_llm.engine.core
    manager = core.structured_outputs
    log: list[str] = []
    lock = threading.Condition()
    schedules = [0]
    submitted: list[int] = []  # the schedule count when each task was handed to the worker
    overlapped: list[bool] = []
    original_ahead = type(manager)._accept_ahead
    original_task = type(manager)._accept_and_fill
    original_schedule = core.scheduler.schedule
    original_apply = GrammarBitmask.apply

    def schedule() -> Any:
        with lock:
            log.append("schedule")
            schedules[0] += 1
            lock.notify_all()
        return original_schedule()

    def ahead(*args: Any) -> Any:
        with lock:
            log.append("ahead submit")
            submitted.append(schedules[0])
        join = original_ahead(manager, *args)
        if join is None:
            with lock:
                log.pop(len(log) - 1 - log[::-1].index("ahead submit"))
                submitted.pop()
        return join

    def task(*args: Any) -> Any:
        with lock:
            seen = submitted[-1]
            overlapped.append(lock.wait_for(lambda: schedules[0] > seen, timeout=1.5 if all(overlapped) else 0))
        result = original_task(manager, *args)
        with lock:
            log.append("ahead end")
        return result

    def apply(self: GrammarBitmask, *args: Any) -> None:
        log.append("apply")
        original_apply(self, *args)

    hook = core.runner.model.register_forward_pre_hook(lambda *_: log.append("forward"))
    manager._accept_ahead = ahead
    manager._accept_and_fill = task
    core.scheduler.schedule = schedule
    GrammarBitmask.apply = apply  # type: ignore[method-assign]
    try:
        got = pipelined_llm.generate(PROMPTS[3:5], PARAMS[3:5], use_tqdm=False)
    finally:
        GrammarBitmask.apply = original_apply  # type: ignore[method-assign]
        hook.remove()
        del core.scheduler.schedule, manager._accept_and_fill, manager._accept_ahead
    for out, schema in zip(got, (PERSON, TAGS)):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    # The last task may see no later step: generate() returns once its requests are done.
    assert len(overlapped) > 10 and all(overlapped[:-1]), overlapped
    applies = [i for i, e in enumerate(log) if e == "apply"]
    assert len(applies) > 10
    for before, at in zip(applies, applies[1:]):
        between = log[before + 1:at]
        # handed over once the step sampled (its mask applied), then the next step's forward launched and the
        # step after it scheduled while the worker ran, then (the worker joined) the next step's mask applied
        # (worker/pipelined_step.py NOTE 5)
        assert between.index("ahead submit") < between.index("forward") < between.index("schedule"), between
        assert between.count("ahead end") == 1 and between.index("ahead end") > between.index("schedule"), between


@pytest.mark.parametrize("raw", [True, False], ids=["raw-binding", "public-wrapper"])
def test_xgrammar_batch_accept_equals_one_token_at_a_time(model_dir: str, raw: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """accept_many's batch path (one `batch_accept_token` call per part: the worker's GIL-light form) against
    xgrammar's own accept_token one grammar at a time: the same verdicts, terminations and next masks, over
    allowed tokens, a forbidden one, a stop token ending a grammar, and grammars already ended. Both ways of
    calling it: the binding directly, its verdicts read in one call (backend.py NOTE 3), and the wrapper."""
    import torch
    from structured_models import smollm2_tokenizer

    from pagedllm.plugins.structured_output.xgrammar import backend as xg
    from pagedllm.protocols.structured_output import StructuredOutputContext

    if xg._BATCH_ACCEPT is None:
        pytest.skip("this xgrammar has no BatchGrammarMatcher.batch_accept_token")
    if raw:
        assert xg._RAW_ACCEPT is not None, "xgrammar's binding moved: backend.py NOTE 3 reads the wrapper's way"
    else:
        monkeypatch.setattr(xg, "_RAW_ACCEPT", None)
    tokenizer = smollm2_tokenizer()
    vocab = len(tokenizer)
    backend = xg.XgrammarBackend(StructuredOutputContext(tokenizer, vocab, (tokenizer.eos_token_id,)))
    compiled = backend.compile(StructuredOutputsParams(choice=["ab", "abc", "b"]))
    n = 12
    batch = [backend.make_grammar(compiled) for _ in range(n)]
    alone = [backend.make_grammar(compiled) for _ in range(n)]
    width = (vocab + 31) // 32
    masks = torch.empty((n, width), dtype=torch.int32)
    expected = torch.empty((n, width), dtype=torch.int32)
    saw = {"rejected": False, "ended": False}
    for step in range(6):
        tokens = []
        for i, g in enumerate(alone):
            if g.is_terminated():  # the extra token after the end, which accept_tokens ignores
                tokens.append([tokenizer.eos_token_id])
                continue
            g.fill_bitmask(expected, i)
            bits = ((expected[i].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
            allowed = bits.nonzero().flatten().tolist()
            pick = allowed[(i + step) % len(allowed)]
            if i == 0 and step == 1:
                pick = next(t for t in range(vocab) if not bits[t])  # a token the grammar forbids
            tokens.append([pick])
        verdicts = xg.XgrammarGrammar.accept_many(batch, tokens)
        reference = [g.accept_tokens("", t) for g, t in zip(alone, tokens)]
        assert verdicts == reference
        assert [g.is_terminated() for g in batch] == [g.is_terminated() for g in alone]
        saw["rejected"] |= not all(reference)
        saw["ended"] |= any(g.is_terminated() for g in alone)
        for i, (g, ok) in enumerate(zip(batch, reference)):
            if ok and not g.is_terminated():
                g.fill_bitmask(masks, i)
                alone[i].fill_bitmask(expected, i)
                assert torch.equal(masks[i], expected[i])
        # a rejected grammar's state is unspecified: start both copies again
        for i, ok in enumerate(reference):
            if not ok:
                batch[i], alone[i] = backend.make_grammar(compiled), backend.make_grammar(compiled)
    assert saw["rejected"] and saw["ended"]
