"""Ray: tensor-parallel ranks as actors, data-parallel replicas, on a local cluster (loopback, 2 CPUs, a small
object store); and the replica balancer alone.

Two replicas of a tiny Llama, each a whole engine in a Ray actor: requests spread over both and come back
with the tokens a single local engine gives; killing one replica's actor fails only the requests it held,
with an error naming it, and the other replica serves everything after.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.load_balancer import NoHealthyReplicaError, ReplicaBalancer

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", block_size=BLOCK, kv_cache_memory_gb=0.01)
PROMPTS = [[1, 10 + i, 20 + 2 * i, 30 + 3 * i, 7, 8] for i in range(10)]


# -- the balancer ---------------------------------------------------------------------------------------


def test_same_first_block_goes_to_the_same_replica_while_loads_are_close() -> None:
    balancer = ReplicaBalancer(2, block_size=BLOCK, slack=2)
    prompt = [5, 6, 7, 8, 9]
    home = balancer.preferred(prompt)
    assert home is not None and balancer.preferred([5, 6, 7, 8, 1, 2, 3]) == home  # only block 0 counts
    # Loads 0, 1, 2 vs 0 are within the slack of 2: the prefix's replica keeps them.
    assert [balancer.pick(prompt) for _ in range(3)] == [home] * 3
    assert balancer.pick(prompt) == 1 - home  # 3 vs 0 is not: the least-loaded replica takes it
    balancer.finished(home)
    balancer.finished(home)
    assert balancer.pick(prompt) == home


def test_short_prompts_spread_round_robin_and_dead_replicas_are_skipped() -> None:
    balancer = ReplicaBalancer(3, block_size=BLOCK)
    assert balancer.preferred([1, 2]) is None
    assert sorted(balancer.pick([1, 2]) for _ in range(3)) == [0, 1, 2]
    balancer.mark_unhealthy(1)
    assert {balancer.pick([1, 2]) for _ in range(4)} == {0, 2}
    balancer.mark_unhealthy(0)
    balancer.mark_unhealthy(2)
    with pytest.raises(NoHealthyReplicaError, match="no healthy data-parallel replica"):
        balancer.pick([1, 2])


# -- replicas on Ray ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2, num_gpus=0, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False,
        _node_ip_address="127.0.0.1",  # loopback only
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.slow  # a local Ray cluster and its actors
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tp2_with_ray_actor_ranks_equals_tp1(ray_cluster: Any, tiny_root: Path, async_scheduling: bool) -> None:
    """The `ray` executor: rank 1 is a Ray actor in a placement group, rank 0 this process (gloo between);
    synchronous steps, and pipelined ones (fire-and-forget actor calls, ids broadcast by rank 0)."""
    model = make_tiny_model("llama", tiny_root)
    with LLM(model, **ENGINE) as single:
        reference = tokens(single.generate(PROMPTS[:3], GREEDY, use_tqdm=False))
    with LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", async_scheduling=async_scheduling,
             **ENGINE) as llm:
        assert llm.engine.parts.selections["executor"].winner.name == "ray"
        assert llm.engine.core.async_scheduling == async_scheduling
        assert tokens(llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)) == reference
        # An unseeded sampled batch in between leaves the ranks in step (and the cache empty).
        llm.generate(PROMPTS[3:], SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True), use_tqdm=False)
        assert tokens(llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)) == reference
        assert llm.engine.kv_cache_usage == 0.0


@pytest.mark.slow  # a local Ray cluster and its actors
def test_two_replicas_share_the_load_and_survive_one_dying(ray_cluster: Any, tiny_root: Path) -> None:
    model = make_tiny_model("llama", tiny_root)
    with LLM(model, **ENGINE) as single:
        reference = tokens(single.generate(PROMPTS, GREEDY, use_tqdm=False))

    llm = LLM(model, data_parallel_size=2, **ENGINE)
    try:
        core = llm.engine.core
        assert llm.engine.executor_selection.winner.name == "ray"
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
        assert all(n > 0 for n in core.served), core.served  # both replicas did work
        served_before = list(core.served)

        ray_cluster.kill(core.replicas[0])
        # Prompts whose first block prefers replica 0 are sent there before anyone knows it is dead.
        doomed = [p for p in PROMPTS if core.balancer.preferred(p) == 0]
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for prompt, out, expected in zip(PROMPTS, outs, reference):
            if out.outputs[0].finish_reason == "error":
                assert prompt in doomed
                assert "data-parallel replica 0 failed" in (out.error or "")
            else:
                assert list(out.outputs[0].token_ids) == expected
        assert any(o.outputs[0].finish_reason == "error" for o in outs)
        assert core.balancer.healthy == [False, True]

        # Afterwards everything goes to replica 1, and is served.
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
        assert core.served[0] == served_before[0]
    finally:
        llm.shutdown()
