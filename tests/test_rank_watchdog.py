"""Issue 26: a tensor-parallel rank's death is seen at once, even while rank 0 is inside a step.

The executors' monitor threads (multiproc: the rank processes' sentinels; ray: the actors' in-flight refs)
call the failure callback the engine core registers; the core's RankWatchdog then reports Fatal itself and
exits if the step has not ended within its grace period (a step NCCL would hold until the group timeout).
The watchdog is tested on its own, over a real ipc socket, with the process exit replaced by a recorder; the
monitors on real rank processes and Ray actors killed mid-generation.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.engine.rank_watchdog import RankWatchdog
from pagedllm.engine.serialization import Fatal, decode_from_core
from pagedllm.protocols.executor import WorkerDiedError

zmq = pytest.importorskip("zmq")

ENGINE = dict(device="cpu", block_size=4, kv_cache_memory_gb=0.01, max_num_seqs=4)
LONG = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


@pytest.fixture
def core_output(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """The API process's end of the core's output socket: (address, bound PULL socket)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = f"ipc://{tmp_path / 'output'}"
    pull.bind(addr)
    try:
        yield addr, pull
    finally:
        pull.close(linger=0)
        ctx.term()


def test_watchdog_reports_fatal_then_exits_when_the_step_does_not_end(core_output: tuple[str, Any]) -> None:
    addr, pull = core_output
    exits: list[int] = []
    watchdog = RankWatchdog(addr, grace_s=0.5, exit_process=exits.append)
    t0 = time.monotonic()
    watchdog.rank_died("tensor-parallel rank 1 (pid 4242) died")
    watchdog.rank_died("reported twice by a second thread")  # one timer, one Fatal
    assert not pull.poll(200), "Fatal before the grace period: a step that fails by itself must get its chance"
    assert pull.poll(5000)
    msg = decode_from_core(pull.recv())
    assert isinstance(msg, Fatal) and "tensor-parallel rank 1 (pid 4242) died" in msg.message, msg
    assert "stuck in a step" in msg.message
    deadline = time.monotonic() + 5
    while not exits:
        assert time.monotonic() < deadline, "the watchdog did not end the process"
        time.sleep(0.01)
    assert exits == [1] and time.monotonic() - t0 >= 0.5
    assert not pull.poll(300)  # and nothing more


def test_watchdog_stays_quiet_once_the_loop_has_reported(core_output: tuple[str, Any]) -> None:
    addr, pull = core_output
    exits: list[int] = []
    watchdog = RankWatchdog(addr, grace_s=0.3, exit_process=exits.append)
    watchdog.rank_died("tensor-parallel rank 1 (pid 4242) died")
    watchdog.disarm()  # the step failed and the loop sent Fatal itself
    assert not pull.poll(1000) and exits == []
    watchdog.rank_died("a late report")
    assert not pull.poll(600) and exits == []


def _kill_mid_generation(llm: LLM, kill: Any) -> tuple[list[str], float, BaseException | None]:
    """Generate in a thread, kill rank 1 once it runs; return the callback's reasons, the seconds from the
    kill to the first one, and what the generation raised."""
    reasons: list[str] = []
    seen = threading.Event()

    def on_failure(reason: str) -> None:
        reasons.append(reason)
        seen.set()

    llm.engine.parts.executor.register_failure_callback(on_failure)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            llm.generate([{"prompt_token_ids": [1, 5, 9, 33]}] * 2, LONG, use_tqdm=False)
        except BaseException as exc:
            raised.append(exc)

    gen = threading.Thread(target=run, daemon=True)
    gen.start()
    deadline = time.monotonic() + 60
    while llm.engine.get_stats().num_steps < 2:  # the steps are running
        assert gen.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    kill()
    t0 = time.monotonic()
    assert seen.wait(10), "the monitor never reported the death"
    took = time.monotonic() - t0
    gen.join(30)
    return reasons, took, raised[0] if raised else None


@pytest.mark.slow  # starts a rank-1 process
def test_multiproc_monitor_reports_a_rank_killed_mid_step(tiny_root: Path) -> None:
    llm = LLM(make_tiny_model("llama", tiny_root), tensor_parallel_size=2,
              distributed_executor_backend="multiproc", **ENGINE)
    try:
        proc = llm.engine.parts.executor._procs[0]
        reasons, took, raised = _kill_mid_generation(llm, lambda: os.kill(proc.pid, signal.SIGKILL))
        assert reasons == [f"tensor-parallel rank 1 (pid {proc.pid}) died"], reasons
        assert took < 2, took  # a sentinel wakes the monitor at once
        assert isinstance(raised, WorkerDiedError) and "tensor-parallel rank 1 (" in str(raised), raised
    finally:
        llm.shutdown()


@pytest.mark.slow  # a local Ray cluster and its actor
def test_ray_monitor_reports_an_actor_killed_mid_step(tiny_root: Path) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, num_gpus=0, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        llm = LLM(make_tiny_model("llama", tiny_root), tensor_parallel_size=2, distributed_executor_backend="ray",
                  **ENGINE)
        try:
            actor = llm.engine.parts.executor._workers[0]
            reasons, took, raised = _kill_mid_generation(llm, lambda: ray.kill(actor))
            assert len(reasons) == 1 and reasons[0].startswith("tensor-parallel rank 1 (Ray actor) failed"), reasons
            assert took < 5, took  # the monitor polls every 0.5 s; Ray needs a moment to see the actor go
            assert isinstance(raised, WorkerDiedError) and "tensor-parallel rank 1 (" in str(raised), raised
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()
