"""The CPU engine's batch limits and KV cache sized from the machine (platform/cpu_sizing.py, host_memory.py,
engine/cpu_sizes.py): the rule on faked core counts and memory, an explicit value winning, a KV size that
cannot fit refused with its key named, and the reasons in `config show --resolve`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from pagedllm import LLM
from pagedllm.platform.cpu_features import CPUFeatures
from pagedllm.platform.cpu_sizing import (
    KV_FLOOR_BYTES,
    KV_MEMORY_SHARE,
    CpuSizingError,
    CpuSizingInputs,
    RequestedSizes,
    size_cpu_engine,
)
from pagedllm.platform.host_memory import HostMemory, host_memory

GIB = 1 << 30
BLOCK = 16
BYTES_PER_BLOCK = 737_280  # SmolLM2-135M in float32: 30 layers x K and V x 3 heads x 64 x 4 bytes x 16 tokens


def _inputs(cores: int = 2, available: int | None = 20 * GIB, max_model_len: int = 8192,
            requested: RequestedSizes | None = None) -> CpuSizingInputs:
    return CpuSizingInputs(
        physical_cores=cores,
        memory=HostMemory(available, "MemAvailable"),
        weights_bytes=97_000_000,
        bytes_per_block=BYTES_PER_BLOCK,
        blocks_per_request=lambda tokens, _chunk: math.ceil(tokens / BLOCK),
        max_model_len=max_model_len,
        requested=requested or RequestedSizes(),
    )


# -- the rule -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("cores", "seqs", "budget"), [(1, 64, 2048), (2, 128, 2048), (3, 192, 3072), (16, 256, 4096)])
def test_batch_limits_follow_the_physical_cores(cores: int, seqs: int, budget: int) -> None:
    sizing = size_cpu_engine(_inputs(cores=cores))
    assert (sizing.max_num_seqs, sizing.max_num_batched_tokens) == (seqs, budget)
    assert f"x {cores}" in sizing.reasons[0] and "sized from the machine" in sizing.reasons[0]


def test_the_kv_cache_holds_max_num_seqs_requests_of_the_sizing_length() -> None:
    sizing = size_cpu_engine(_inputs(cores=2))
    # 128 requests of 512 tokens (32 blocks each) and the null block: 2.8 GiB, more than the old 1 GiB.
    assert sizing.kv_bytes == (1 + 128 * 32) * BYTES_PER_BLOCK
    assert "room for 128 requests of 512 tokens" in sizing.reasons[2]
    assert "20.0 GiB available (MemAvailable)" in sizing.reasons[2]


def test_a_small_model_keeps_at_least_the_old_fixed_cache() -> None:
    tiny = CpuSizingInputs(1, HostMemory(20 * GIB, "MemAvailable"), 10_000, 8192, lambda t, _c: math.ceil(t / 16), 512)
    sizing = size_cpu_engine(tiny)
    assert sizing.kv_bytes == KV_FLOOR_BYTES
    assert "at least the fixed default 1 GiB" in sizing.reasons[2]


@pytest.mark.parametrize("available_gib", [0.25, 1.0, 1.5, 3.0, 6.0, 20.0, 500.0])
@pytest.mark.parametrize("cores", [1, 2, 8])
def test_never_more_kv_than_the_safe_share_of_available_memory(available_gib: float, cores: int) -> None:
    available = int(available_gib * GIB)
    sizing = size_cpu_engine(_inputs(cores=cores, available=available))
    assert sizing.kv_bytes is not None
    assert sizing.kv_bytes <= KV_MEMORY_SHARE * available
    # and the batch is one the cache can hold: max_num_seqs requests of 512 tokens (32 blocks) at once
    assert sizing.max_num_seqs * 32 * BYTES_PER_BLOCK <= sizing.kv_bytes


def test_short_memory_cuts_the_cache_and_lowers_max_num_seqs() -> None:
    sizing = size_cpu_engine(_inputs(cores=4, available=2 * GIB))  # 1 GiB may go to the cache
    assert sizing.kv_bytes == GIB
    holds = (GIB - BYTES_PER_BLOCK) // (32 * BYTES_PER_BLOCK)  # 45 requests of 512 tokens
    assert sizing.max_num_seqs == holds < 256
    assert f"lowered to the {holds} requests of 512 tokens" in sizing.reasons[0]
    assert "cut to 50% of the 2.0 GiB available" in sizing.reasons[2]


def test_unreadable_memory_falls_back_to_the_fixed_cache() -> None:
    sizing = size_cpu_engine(_inputs(available=None))
    assert sizing.kv_bytes == KV_FLOOR_BYTES and "could not be read" in sizing.reasons[2]


def test_explicit_values_win() -> None:
    requested = RequestedSizes(max_num_seqs=7, max_num_batched_tokens=300, memory_gb=0.5)
    sizing = size_cpu_engine(_inputs(cores=16, requested=requested))
    assert (sizing.max_num_seqs, sizing.max_num_batched_tokens, sizing.kv_bytes) == (7, 300, GIB // 2)
    assert "scheduler.max_num_seqs, config" in sizing.reasons[0]
    assert "scheduler.max_num_batched_tokens (config)" in sizing.reasons[1]
    assert "kv_cache.memory_gb, config" in sizing.reasons[2]


def test_an_explicit_max_num_seqs_sizes_the_cache() -> None:
    sizing = size_cpu_engine(_inputs(cores=2, requested=RequestedSizes(max_num_seqs=200)))
    assert sizing.max_num_seqs == 200 and sizing.kv_bytes == (1 + 200 * 32) * BYTES_PER_BLOCK


def test_an_explicit_token_budget_bounds_the_automatic_max_num_seqs() -> None:
    sizing = size_cpu_engine(_inputs(cores=2, requested=RequestedSizes(max_num_batched_tokens=100)))
    assert (sizing.max_num_seqs, sizing.max_num_batched_tokens) == (100, 100)
    assert "lowered to scheduler.max_num_batched_tokens 100" in sizing.reasons[0]


def test_an_explicit_num_blocks_leaves_the_cache_to_the_config() -> None:
    sizing = size_cpu_engine(_inputs(requested=RequestedSizes(num_blocks=64)))
    assert sizing.kv_bytes is None and "kv_cache.num_blocks, config" in sizing.reasons[2]


@pytest.mark.parametrize(("requested", "key"), [
    (RequestedSizes(memory_gb=24.0), "kv_cache.memory_gb 24"),
    (RequestedSizes(num_blocks=40_000), "kv_cache.num_blocks 40000"),  # 27.5 GiB
])
def test_a_cache_that_cannot_fit_is_refused_naming_the_key(requested: RequestedSizes, key: str) -> None:
    with pytest.raises(CpuSizingError, match=key) as info:
        size_cpu_engine(_inputs(available=20 * GIB, requested=requested))
    assert "only 20.00 GiB is available (MemAvailable)" in str(info.value)
    # the same value fits a bigger machine
    assert size_cpu_engine(_inputs(available=64 * GIB, requested=requested)).reasons


# -- the memory reading ---------------------------------------------------------------------------------------

def _fake_root(tmp_path: Path, available_kib: int, cgroup: dict[str, str] | None = None,
               self_cgroup: str = "0::/\n") -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    (tmp_path / "proc/self/cgroup").write_text(self_cgroup)
    for name, text in (cgroup or {}).items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_memavailable_without_a_cgroup_limit(tmp_path: Path) -> None:
    root = _fake_root(tmp_path, 8 * 1024 * 1024, {"memory.max": "max\n", "memory.current": "123\n"})
    assert host_memory(root) == HostMemory(8 * GIB, "MemAvailable")


def test_a_cgroup_v2_limit_below_memavailable_wins(tmp_path: Path) -> None:
    root = _fake_root(tmp_path, 8 * 1024 * 1024, {
        "box/memory.max": f"{4 * GIB}\n", "box/memory.current": f"{2 * GIB}\n",
        "box/memory.stat": f"anon 1\ninactive_file {GIB}\n",  # reclaimable page cache: not in use
    }, self_cgroup="0::/box\n")
    memory = host_memory(root)
    assert memory.available_bytes == 3 * GIB
    assert memory.source == "the cgroup's limit (4.0 GiB, 1.0 GiB in use)"


def test_a_cgroup_v1_limit_is_read_too(tmp_path: Path) -> None:
    root = _fake_root(tmp_path, 8 * 1024 * 1024, {
        "memory/memory.limit_in_bytes": f"{2 * GIB}\n", "memory/memory.usage_in_bytes": f"{GIB // 2}\n",
        "memory/memory.stat": "total_inactive_file 0\n",
    }, self_cgroup="4:memory:/\n")
    assert host_memory(root).available_bytes == GIB + GIB // 2


def test_a_cgroup_limit_above_memavailable_does_not_raise_it(tmp_path: Path) -> None:
    root = _fake_root(tmp_path, 1024 * 1024, {"memory.max": f"{64 * GIB}\n", "memory.current": "0\n"})
    assert host_memory(root) == HostMemory(GIB, "MemAvailable")


def test_this_machines_memory_reads() -> None:
    memory = host_memory()
    assert memory.available_bytes is not None and memory.available_bytes > 0


# -- the engine -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tiny_root: Path) -> str:
    return make_tiny_model("llama", tiny_root)


def _fake_machine(monkeypatch: pytest.MonkeyPatch, cores: int, available: int) -> None:
    import pagedllm.engine.cpu_sizes as cpu_sizes

    # conftest.py fixes the suite's KV budget through the environment (an explicit value): unset it here.
    monkeypatch.delenv("PAGEDLLM_KV_CACHE__MEMORY_GB", raising=False)

    monkeypatch.setattr(cpu_sizes, "cpu_features", lambda: CPUFeatures(frozenset(), cores, cores))
    monkeypatch.setattr(cpu_sizes, "host_memory", lambda: HostMemory(available, "MemAvailable"))


def test_the_engine_takes_the_sizes_from_the_machine(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 MiB available: at most 32 MiB of cache, 4096 blocks of the tiny llama's 8 KiB (2 layers x K, V x 2
    # heads x 16 x 4 bytes x 16 tokens); 4 cores would want 256 sequences, the cache holds 127 of 512 tokens.
    _fake_machine(monkeypatch, cores=4, available=64 << 20)
    llm = LLM(tiny_llama, device="cpu", dtype="float32")
    try:
        parts = llm.engine.parts
        assert parts.num_blocks == 4096
        assert parts.config.scheduler.max_num_seqs == 127
        assert parts.config.scheduler.max_num_batched_tokens == 4096
        assert parts.scheduler.config.max_num_seqs == 127  # the scheduler was built on the resolved config
        text = parts.describe()
        assert "max_num_seqs 127 (sized from the machine: 64 per physical core x 4" in text
        assert "kv cache 0.03 GiB (sized from the machine" in text
    finally:
        llm.shutdown()


def test_the_engines_explicit_values_win(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_machine(monkeypatch, cores=4, available=64 << 20)
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_num_seqs=5, max_num_batched_tokens=256,
              kv_cache_memory_gb=0.01)
    try:
        parts = llm.engine.parts
        assert (parts.config.scheduler.max_num_seqs, parts.config.scheduler.max_num_batched_tokens) == (5, 256)
        assert parts.num_blocks == int(0.01 * (1 << 30)) // 8192
    finally:
        llm.shutdown()


def test_the_engine_refuses_a_cache_larger_than_memory(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_machine(monkeypatch, cores=2, available=512 << 20)
    with pytest.raises(ValueError, match=r"kv_cache.memory_gb 1: the KV cache would take 1.00 GiB but only 0.50 GiB"):
        LLM(tiny_llama, device="cpu", dtype="float32", kv_cache_memory_gb=1.0)


def test_config_show_resolve_says_the_sizes_and_why(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedllm.cli.main import main

    _fake_machine(monkeypatch, cores=3, available=64 << 20)
    assert main(["config", "show", "--resolve", "--model", tiny_llama, "--device", "cpu", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "# max_num_seqs 127 (sized from the machine: 64 per physical core x 3" in out
    assert "# max_num_batched_tokens 3072 (sized from the machine: 1024 per physical core x 3" in out
    assert "# kv cache 0.03 GiB (sized from the machine" in out
    assert "max_num_seqs: 127" in out  # the YAML shows the resolved values, not the fixed defaults


def test_the_config_sent_to_another_process_keeps_unset_sizes_unset() -> None:
    from pagedllm.config import EngineConfig

    config = EngineConfig.from_dict({"scheduler": {"max_num_batched_tokens": 512}}, {"kv_cache.block_size": 32},
                                    env={})  # not conftest.py's PAGEDLLM_KV_CACHE__MEMORY_GB
    config.parallel.data_parallel_size = 1  # set in place on a default section: still sent
    received = EngineConfig.model_validate(config.to_process_dict())
    assert received == config
    assert received.scheduler.model_fields_set == {"max_num_batched_tokens"}
    assert "memory_gb" not in received.kv_cache.model_fields_set
    assert received.parallel.model_fields_set == {"data_parallel_size"}
    # what a plain dump does instead: every key looks set, so nothing would be sized from the machine
    assert "max_num_seqs" in EngineConfig.model_validate(config.model_dump()).scheduler.model_fields_set


def test_the_engine_core_process_sizes_and_tells_the_frontend(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's engine core builds from the dict the frontend sends (core_client.py) and reports its
    resolved max_num_seqs in Ready, which the frontend's waiting bound uses (async_llm.py)."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.core_proc import _build

    _fake_machine(monkeypatch, cores=4, available=64 << 20)
    config = EngineConfig.from_dict({"model": tiny_llama, "device": "cpu", "dtype": "float32"})
    core, ready = _build(config.to_process_dict())
    try:
        assert ready.max_num_seqs == 127 and ready.num_blocks == 4096
    finally:
        core.shutdown()


def test_an_engine_config_object_leaves_the_sizes_to_the_machine(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LLM(config=EngineConfig(...))`, as `pagedllm bench` builds it: the object is re-validated with the
    keyword overrides on top (llm_engine.py), which must not turn its unset sizes into set ones."""
    from pagedllm.config import EngineConfig

    _fake_machine(monkeypatch, cores=4, available=64 << 20)
    llm = LLM(config=EngineConfig.from_dict({"model": tiny_llama, "device": "cpu", "dtype": "float32"}))
    try:
        assert llm.engine.parts.config.scheduler.max_num_seqs == 127
        assert llm.engine.parts.num_blocks == 4096
    finally:
        llm.shutdown()
