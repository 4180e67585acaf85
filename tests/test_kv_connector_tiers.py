"""The `tiered` KV connector: blocks the device pool evicts are kept in host memory and on disk, and prefix
hits come back from there, changing no greedy token.

The device pool is deliberately tiny (kv_cache.num_blocks), so the shared prefixes of the workload cannot stay
on the device between the requests that share them; the reference tokens come from transformers.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tiny_models import hf_greedy, make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.kv_cache.hashing import hash_block_tokens
from pagedllm.plugin_manager import get_plugin_manager
from pagedllm.plugin_spec import PluginKind
from pagedllm.selection_context import KVConnectorCheckContext
from pagedllm.selector import SelectionError, select

BLOCK = 4
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 4 prefixes of 12 blocks each, 3 rounds of a request per prefix with its own 5-token suffix: one request
# holds 15 blocks, the pool 20 (19 usable), so no prefix survives on the device until its next request.
NUM_BLOCKS = 20


@pytest.fixture(scope="module")
def model_dir(tiny_root: Path) -> str:
    return make_tiny_model("llama", tiny_root)


@pytest.fixture(scope="module")
def workload() -> list[list[int]]:
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 384) for _ in range(12 * BLOCK)] for _ in range(4)]
    return [p + [rng.randrange(3, 384) for _ in range(5)] for _ in range(3) for p in prefixes]


@pytest.fixture(scope="module")
def reference(model_dir: str, workload: list[list[int]]) -> list[list[int]]:
    return [ids for ids, _ in hf_greedy(model_dir, workload, MAX_TOKENS)]


def _llm(model_dir: str, **tiered: Any) -> LLM:
    kwargs: dict[str, Any] = {}
    if tiered:
        kwargs = {"kv_transfer_config": {"kv_connector": "tiered"}, "plugins": {"tiered": tiered}}
    return LLM(model_dir, kv_cache={"num_blocks": NUM_BLOCKS, "block_size": BLOCK}, max_num_seqs=1,
               num_threads=1, **kwargs)


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """One request at a time, in order (the workload's order decides what the device pool still holds)."""
    tokens, cached = [], []
    for p in prompts:
        out = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0]
        tokens.append(out.outputs[0].token_ids)
        cached.append(out.num_cached_tokens)
    return tokens, cached


def _block_bytes(llm: LLM) -> int:
    return llm.engine.parts.runner.kv_connector.io.block_bytes


def test_host_tier_serves_most_prompt_tokens_and_changes_no_token(model_dir, workload, reference) -> None:
    plain = _llm(model_dir)
    plain_tokens, plain_cached = _run(plain, workload)
    assert plain_tokens == reference
    assert sum(plain_cached) < len(workload) * BLOCK  # the device pool alone keeps (almost) nothing

    llm = _llm(model_dir, host_gb=0.5)
    tokens, cached = _run(llm, workload)
    assert tokens == reference
    stats = llm.get_stats().kv_connector
    prompt_tokens = sum(map(len, workload))
    assert stats["host_hit_tokens"] > prompt_tokens / 2
    # Rounds 2 and 3: the whole 12-block prefix of each request came from the host tier.
    assert cached[4:] == [12 * BLOCK] * 8
    assert sum(cached) - sum(plain_cached) >= stats["host_hit_tokens"] - 4 * BLOCK
    bb = _block_bytes(llm)
    assert stats["host_loaded_bytes"] == stats["host_hit_tokens"] // BLOCK * bb
    assert stats["host_saved_bytes"] > 0 and stats["host_saved_bytes"] % bb == 0
    assert stats["disk_hit_tokens"] == 0 and stats["disk_blocks"] == 0
    assert llm.engine.kv_cache_usage == 0.0
    assert llm.engine.parts.selections["kv_connector"].winner.name == "tiered"
    _check_metrics(llm.get_stats())


def _check_metrics(stats: Any) -> None:
    """The server's /metrics collector exposes the connector's counters from the engine's stats."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pagedllm.plugins.server.metrics import _EngineStatsCollector

    engine = SimpleNamespace(stats=stats, model_name="tiny", healthy=True, restarts=0)
    registry = CollectorRegistry()
    registry.register(_EngineStatsCollector(engine))
    text = generate_latest(registry).decode()
    hits = stats.kv_connector["host_hit_tokens"]
    assert f'pagedllm:kv_connector_host_hit_tokens_total{{model_name="tiny"}} {float(hits)}' in text
    assert "# TYPE pagedllm:kv_connector_host_blocks gauge" in text
    # Read back with prometheus_client's own parser: per-tier hit rates over the prompt tokens looked up, and
    # the bytes each tier moved.
    from prometheus_client.parser import text_string_to_metric_families

    values = {m.name: m.samples[0].value for m in text_string_to_metric_families(text) if m.samples}
    queries = values["pagedllm:prefix_cache_queries"]
    assert queries == stats.prefix_cache_queries > 0
    for tier in ("host", "disk"):
        tier_hits = stats.kv_connector[f"{tier}_hit_tokens"]
        assert values[f"pagedllm:kv_connector_{tier}_hit_rate"] == pytest.approx(tier_hits / queries)
        assert values[f"pagedllm:kv_connector_{tier}_hit_tokens"] == tier_hits
    for key in ("host_saved_bytes", "host_loaded_bytes", "disk_written_bytes", "disk_loaded_bytes"):
        assert values[f"pagedllm:kv_connector_{key}"] == stats.kv_connector[key]
    assert values["pagedllm:kv_connector_loading_requests"] == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batched_chunked_rounds_with_tiers(model_dir, workload, reference, async_scheduling: bool) -> None:
    """Each round's 4 requests at once, prefills chunked (32-token budget), with async scheduling too: evictions,
    saves and loads of several requests share steps (and a step's plan runs while the next is scheduled)."""
    llm = LLM(model_dir, kv_cache={"num_blocks": 36, "block_size": BLOCK}, max_num_seqs=4,
              max_num_batched_tokens=32, num_threads=1, async_scheduling=async_scheduling,
              kv_transfer_config={"kv_connector": "tiered"}, plugins={"tiered": {"host_gb": 0.5}})
    assert llm.engine.core.async_scheduling is async_scheduling
    tokens: list[list[int]] = []
    cached: list[int] = []
    for r in range(3):
        outs = llm.generate([{"prompt_token_ids": p} for p in workload[4 * r : 4 * r + 4]], GREEDY, use_tqdm=False)
        tokens += [o.outputs[0].token_ids for o in outs]
        cached += [o.num_cached_tokens for o in outs]
    assert tokens == reference
    assert cached[4:] == [12 * BLOCK] * 8
    assert llm.get_stats().kv_connector["host_hit_tokens"] > sum(map(len, workload)) / 2
    assert llm.engine.kv_cache_usage == 0.0


def _disk_llm(model_dir: str, disk: Path, host_blocks: int, bb: int) -> LLM:
    return _llm(model_dir, host_gb=host_blocks * bb / 2**30, disk_dir=str(disk), disk_gb=1.0)


def test_disk_tier_under_a_small_host_tier(model_dir, workload, reference, tmp_path: Path) -> None:
    probe = _llm(model_dir, host_gb=0.01)
    bb = _block_bytes(probe)
    # The host tier holds 6 blocks, half a prefix: by the time a prefix comes back, three other prefixes were
    # evicted after it, so its blocks were demoted to disk and every hit is read (and verified) from there.
    llm = _disk_llm(model_dir, tmp_path, 6, bb)
    tokens, cached = _run(llm, workload)
    assert tokens == reference
    stats = llm.get_stats().kv_connector
    assert stats["disk_hit_tokens"] > sum(map(len, workload)) / 2
    assert stats["disk_loaded_bytes"] == stats["disk_hit_tokens"] // BLOCK * bb
    assert cached[4:] == [12 * BLOCK] * 8
    assert stats["disk_written_bytes"] > 0 and stats["disk_corrupt_files"] == 0
    assert llm.engine.kv_cache_usage == 0.0
    _check_metrics(llm.get_stats())

    # A second engine finds the first one's files: its first round already hits the disk tier.
    llm.engine.parts.runner.kv_connector.flush()
    again = _disk_llm(model_dir, tmp_path, 6, bb)
    tokens2, cached2 = _run(again, workload[:4])
    assert tokens2 == reference[:4]
    assert again.get_stats().kv_connector["disk_hit_tokens"] > 0 and sum(cached2) > 0


def test_corrupt_or_truncated_disk_files_are_misses(model_dir, workload, reference, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    probe = _llm(model_dir, host_gb=0.01)
    bb = _block_bytes(probe)
    writer = _disk_llm(model_dir, tmp_path, 2, bb)
    assert _run(writer, workload[:4])[0] == reference[:4]
    writer.engine.parts.runner.kv_connector.flush()  # the write-behind queue is on disk
    files = sorted(tmp_path.rglob("*.kvblock"))
    names = {path.stem for path in files}
    # The reader's hit for a prompt is the leading run of its blocks that have a file; it reads them all
    # (in the background) and finds each one bad.
    tried = sum(_leading_run(p, names) for p in workload[:4])
    assert len(files) >= 8 and tried >= 2
    for i, path in enumerate(files):  # every file damaged: one bit flipped in the payload, or cut short
        raw = bytearray(path.read_bytes())
        if i % 2:
            path.write_bytes(raw[: len(raw) // 2])
        else:
            raw[-3] ^= 0x10
            path.write_bytes(bytes(raw))

    reader = _disk_llm(model_dir, tmp_path, 2, bb)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        tokens, cached = _run(reader, workload[:4])
    assert tokens == reference[:4]
    assert "checksum does not match" in caplog.text and "truncated" in caplog.text
    stats = reader.get_stats().kv_connector
    assert stats["disk_corrupt_files"] == tried
    assert stats["disk_hit_tokens"] == 0 and sum(cached) == 0
    assert reader.engine.kv_cache_usage == 0.0


def _leading_run(prompt: list[int], names: set[str]) -> int:
    """How many of the prompt's first blocks (not its last token's) have a file, from the first on."""
    parent, n = None, 0
    for i in range(0, (len(prompt) - 1) // BLOCK * BLOCK, BLOCK):
        parent = hash_block_tokens(parent, prompt[i : i + BLOCK])
        if parent.hex() not in names:
            break
        n += 1
    return n


def test_kind_registration_and_selection() -> None:
    pm = get_plugin_manager()
    names = [c.name for c in pm.components(PluginKind.KV_CONNECTOR)]
    assert "tiered" in names
    assert PluginKind.KV_CONNECTOR.entry_point_group == "pagedllm.kv_connectors"
    ok = KVConnectorCheckContext(device="cpu", num_kv_groups=1, kv_spec_types=("FullAttentionSpec",), world_size=1,
                                 enable_prefix_caching=True)
    sel = select(pm, PluginKind.KV_CONNECTOR, ok, requested="tiered", requested_by="config kv_transfer.kv_connector")
    assert sel.winner.name == "tiered" and "requested by config kv_transfer.kv_connector" in sel.explain()
    bad = KVConnectorCheckContext(device="cpu", num_kv_groups=2, kv_spec_types=("FullAttentionSpec", "MambaSpec"),
                                  world_size=2, enable_prefix_caching=False)
    with pytest.raises(SelectionError, match="prefix caching.*one KV-cache group.*one rank"):
        select(pm, PluginKind.KV_CONNECTOR, bad, requested="tiered")
    window = KVConnectorCheckContext(device="cpu", num_kv_groups=1, kv_spec_types=("SlidingWindowSpec",),
                                     world_size=1, enable_prefix_caching=True)
    with pytest.raises(SelectionError, match="full attention only"):
        select(pm, PluginKind.KV_CONNECTOR, window, requested="tiered")
    # Never chosen unasked: without a name, no connector (and the selector says why).
    with pytest.raises(SelectionError, match="only used when asked for by name"):
        select(pm, PluginKind.KV_CONNECTOR, ok)


def test_config_names_and_options_are_checked(model_dir: str) -> None:
    assert EngineConfig.from_dict({}).kv_transfer.kv_connector is None
    with pytest.raises(Exception, match="no kv_connector named 'no-such-connector'; available: (.*, )?tiered"):
        LLM(model_dir, kv_transfer_config={"kv_connector": "no-such-connector"})
    with pytest.raises(Exception, match="plugins.tiered.host_gb"):
        LLM(model_dir, kv_transfer_config={"kv_connector": "tiered"}, plugins={"tiered": {"host_gb": -1}})
    with pytest.raises(Exception, match="prefix caching"):
        LLM(model_dir, enable_prefix_caching=False, kv_transfer_config={"kv_connector": "tiered"})


def test_no_connector_means_no_plan(model_dir: str) -> None:
    llm = LLM(model_dir, kv_cache={"num_blocks": NUM_BLOCKS, "block_size": BLOCK}, num_threads=1)
    parts = llm.engine.parts
    assert parts.scheduler.kv_connector is None and parts.runner.kv_connector is None
    assert parts.kv_cache_manager.block_pool.evict_listener is None and "kv_connector" not in parts.selections
    assert llm.get_stats().kv_connector == {}
