"""The start-up warning when the machine's load makes the engine's CPU thread count slow (issue 33 item 5)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from pagedllm.engine.thread_load import overload_warning


@pytest.mark.parametrize(("threads", "load", "cores", "suggested"), [
    (2, 3.96, 2, 1),  # issue 33's machine: two threads on two cores that other processes keep busy
    (16, 12.0, 16, 4),
    (8, 30.0, 8, 1),
])
def test_busy_machine_warns_naming_the_flag_and_a_count(threads: int, load: float, cores: int, suggested: int) -> None:
    message = overload_warning(threads, load, cores)
    assert message is not None
    assert f"--num-threads {suggested}" in message
    assert f"load average is {load:.1f} on {cores} CPU cores" in message
    assert f"runs {threads} CPU threads" in message


@pytest.mark.parametrize(("threads", "load", "cores"), [
    (2, 0.3, 2),  # an idle machine
    (2, 1.0, 2),  # one other process: one core left waiting at most
    (1, 9.0, 2),  # already one thread: nothing fewer to suggest
    (4, 2.0, 16),
])
def test_no_warning_when_the_threads_have_cores(threads: int, load: float, cores: int) -> None:
    assert overload_warning(threads, load, cores) is None


def test_engine_start_up_logs_it_for_the_thread_count_it_runs(
    tiny_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pagedllm import LLM

    model = make_tiny_model("llama", tiny_root)
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm"):
            LLM(model, num_threads=2, device="cpu", num_kv_blocks=16).shutdown()
        warned = [r.getMessage() for r in caplog.records if "--num-threads" in r.getMessage()]
        assert len(warned) == 1 and "runs 2 CPU threads" in warned[0] and "--num-threads 1" in warned[0]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagedllm"):
            LLM(model, num_threads=1, device="cpu", num_kv_blocks=16).shutdown()
        assert not [r for r in caplog.records if "--num-threads" in r.getMessage()]
    finally:
        torch.set_num_threads(before)
