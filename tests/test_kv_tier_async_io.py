"""The `tiered` connector's disk tier works in the background: reads park their request, writes go behind.

A hit that includes a block on disk parks the request (WAITING_FOR_REMOTE_KVS) while the tier's I/O thread
reads and verifies the files; the rest of the batch runs on. The disk backend's test double (`_gate`) holds
its reads or writes until the test lets them go, so "a slow disk does not stall the steps" is shown by
order, not by timing. Reference tokens come from transformers.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_models import hf_greedy, make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.kv_cache.hashing import hash_block_tokens
from pagedllm.request import RequestStatus

BLOCK = 4
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
NUM_BLOCKS = 20  # one request holds 15 blocks: a prefix never survives on the device past the next request
PREFIX_BLOCKS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_root: Path) -> str:
    return make_tiny_model("llama", tiny_root)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    """Three prefixes with two suffixes each ('p0a', 'p0b', ...), and an unrelated prompt ('other')."""
    rng = random.Random(11)
    out: dict[str, list[int]] = {}
    for i in range(3):
        prefix = [rng.randrange(3, 384) for _ in range(PREFIX_BLOCKS * BLOCK)]
        for tag in "ab":
            out[f"p{i}{tag}"] = prefix + [rng.randrange(3, 384) for _ in range(5)]
    out["other"] = [rng.randrange(3, 384) for _ in range(22)]
    return out


@pytest.fixture(scope="module")
def reference(model_dir: str, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    names = list(prompts)
    return dict(zip(names, (ids for ids, _ in hf_greedy(model_dir, [prompts[n] for n in names], MAX_TOKENS)),
                    strict=True))


@pytest.fixture(scope="module")
def disk_files(model_dir: str, prompts: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A disk tier holding the three prefixes' blocks, written by an engine whose host tier holds 2 blocks."""
    root = tmp_path_factory.mktemp("kv_disk")
    writer = _llm(model_dir, root, host_blocks=2)
    rng = random.Random(5)
    fillers = [[rng.randrange(3, 384) for _ in range(len(prompts["p0a"]))] for _ in range(2)]
    # Each request evicts the one before it from the device; two unrelated ones push the last prefix's
    # blocks through the 2-block host tier onto the disk.
    for ids in [prompts["p0a"], prompts["p1a"], prompts["p2a"], *fillers]:
        writer.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    _connector(writer).flush()
    for name in ("p0a", "p1a", "p2a"):
        assert _leading_files(prompts[name], root) == PREFIX_BLOCKS, name
    return root


def _llm(model_dir: str, disk: Path, host_blocks: int = 64, **kwargs: Any) -> LLM:
    # A tiny model's block is 2 KiB (2 layers x K, V x 4 tokens x 2 heads x 16 dims x 4 bytes).
    tiered = {"host_gb": host_blocks * 2048 / 2**30, "disk_dir": str(disk), "disk_gb": 1.0,
              **kwargs.pop("tiered", {})}
    kv = {"num_blocks": kwargs.pop("num_blocks", NUM_BLOCKS), "block_size": BLOCK}
    llm = LLM(model_dir, kv_cache=kv, num_threads=1, kv_transfer_config={"kv_connector": "tiered"},
              plugins={"tiered": tiered}, **{"max_num_seqs": 1, **kwargs})
    assert _connector(llm).io.block_bytes == 2048
    return llm


def _connector(llm: LLM) -> Any:
    return llm.engine.parts.runner.kv_connector


def _leading_files(prompt: list[int], root: Path) -> int:
    names = {p.stem for p in root.rglob("*.kvblock")}
    parent, n = None, 0
    for i in range(0, PREFIX_BLOCKS * BLOCK, BLOCK):
        parent = hash_block_tokens(parent, prompt[i : i + BLOCK])
        if parent.hex() not in names:
            break
        n += 1
    return n


def _gate(obj: Any, name: str) -> threading.Event:
    """The disk backend's test double: `obj.name` (a DiskTier file operation) waits until the event is set
    (at most 60 s, so a step that waits for it fails the test instead of hanging it)."""
    release = threading.Event()
    real: Callable[..., Any] = getattr(obj, name)

    def held(*args: Any) -> Any:
        release.wait(timeout=60)
        return real(*args)

    setattr(obj, name, held)
    return release


def _drive(llm: LLM, until: Callable[[dict[str, Any]], bool], done: dict[str, Any], max_steps: int = 400) -> int:
    """Step the engine until `until(done)`; `done` collects finished outputs by request id. Returns the steps."""
    engine = llm.engine
    for step in range(max_steps):
        if until(done):
            return step
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError(f"not reached in {max_steps} steps; finished: {sorted(done)}")


def test_slow_disk_read_does_not_stall_unrelated_requests(model_dir, prompts, reference, disk_files) -> None:
    llm = _llm(model_dir, disk_files, max_num_seqs=4)
    connector = _connector(llm)
    release = _gate(connector.disk_io.tier, "load")
    engine = llm.engine
    engine.add_request("hit", {"prompt_token_ids": prompts["p0b"]}, GREEDY)
    engine.add_request("other", {"prompt_token_ids": prompts["other"]}, GREEDY)
    done: dict[str, Any] = {}
    _drive(llm, lambda d: "other" in d, done)
    # The unrelated request ran to its end while the hit's reads were held: it never waited for the disk.
    assert "hit" not in done and not release.is_set()
    parked = engine.core.scheduler.requests["hit"]
    assert parked.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert connector.stats()["loading_requests"] == 1 and llm.get_stats().num_waiting == 1
    assert list(done["other"].outputs[0].token_ids) == reference["other"]
    release.set()
    _drive(llm, lambda d: "hit" in d, done)
    assert list(done["hit"].outputs[0].token_ids) == reference["p0b"]
    assert done["hit"].num_cached_tokens == PREFIX_BLOCKS * BLOCK
    stats = llm.get_stats().kv_connector
    assert stats["disk_hit_tokens"] == PREFIX_BLOCKS * BLOCK and stats["loading_requests"] == 0
    assert stats["disk_loaded_bytes"] == PREFIX_BLOCKS * 2048
    assert llm.engine.kv_cache_usage == 0.0


def test_parked_blocks_are_not_a_device_hit_before_they_load(model_dir, prompts, reference, disk_files) -> None:
    """A second request of the same prefix, arriving while the first is parked, must not hit the first one's
    blocks on the device (their KV is not there yet); an aborted parked request gives its blocks back."""
    llm = _llm(model_dir, disk_files, max_num_seqs=4, num_blocks=48)
    connector = _connector(llm)
    release = _gate(connector.disk_io.tier, "load")
    engine = llm.engine
    engine.add_request("first", {"prompt_token_ids": prompts["p1a"]}, GREEDY)
    engine.add_request("gone", {"prompt_token_ids": prompts["p2a"]}, GREEDY)
    done: dict[str, Any] = {}
    _drive(llm, lambda d: len(engine.core.scheduler.loading) == 2, done)
    engine.add_request("second", {"prompt_token_ids": prompts["p1b"]}, GREEDY)
    _drive(llm, lambda d: "second" in engine.core.scheduler.loading, done)
    engine.abort_request("gone")
    release.set()
    _drive(llm, lambda d: not engine.has_unfinished_requests(), done)
    assert list(done["first"].outputs[0].token_ids) == reference["p1a"]
    assert list(done["second"].outputs[0].token_ids) == reference["p1b"]
    # The writer ran p1a itself, so its 13th block (prefix and suffix) is on disk too; p1b shares 12.
    assert (done["first"].num_cached_tokens, done["second"].num_cached_tokens) == (52, 48)
    connector.flush()
    assert engine.kv_cache_usage == 0.0 and connector.stats()["loading_requests"] == 0
    # The aborted request's reads came back after it ended, and were dropped: nothing was loaded for it.
    assert connector.stats()["disk_hit_tokens"] == 52 + 48


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batched_background_loads_match_transformers(model_dir, prompts, reference, disk_files,
                                                     async_scheduling: bool) -> None:
    """Six requests at once, prefills chunked: several parked at once, resumed in different steps, beside
    requests without a hit; a slow disk (5 ms a read) keeps reads in flight across steps."""
    llm = _llm(model_dir, disk_files, max_num_seqs=4, num_blocks=64, max_num_batched_tokens=32,
               async_scheduling=async_scheduling)
    tier = _connector(llm).disk_io.tier
    real_load = tier.load

    def slow_load(block_hash: bytes) -> Any:
        threading.Event().wait(0.005)
        return real_load(block_hash)

    tier.load = slow_load
    names = ["p0b", "other", "p1b", "p2b", "p0a", "p2a"]
    outs = llm.generate([{"prompt_token_ids": prompts[n]} for n in names], GREEDY, use_tqdm=False)
    assert {n: list(o.outputs[0].token_ids) for n, o in zip(names, outs, strict=True)} == \
        {n: reference[n] for n in names}
    cached = {n: o.num_cached_tokens for n, o in zip(names, outs, strict=True)}
    assert all(cached[n] >= PREFIX_BLOCKS * BLOCK for n in names if n != "other")
    stats = llm.get_stats().kv_connector
    assert stats["disk_hit_tokens"] >= 3 * PREFIX_BLOCKS * BLOCK and stats["loading_requests"] == 0
    assert llm.engine.kv_cache_usage == 0.0


def test_one_corrupt_file_ends_the_hit_there(model_dir, prompts, reference, disk_files, tmp_path: Path) -> None:
    """Block 5 of a 12-block run fails its checksum: the first 5 blocks load, the rest are recomputed."""
    root = tmp_path / "copy"
    for path in disk_files.rglob("*.kvblock"):
        target = root / path.relative_to(disk_files)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    parent = None
    for i in range(6):
        parent = hash_block_tokens(parent, prompts["p2b"][i * BLOCK : (i + 1) * BLOCK])
    (bad,) = root.rglob(parent.hex() + ".kvblock")
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0x01
    bad.write_bytes(bytes(raw))
    llm = _llm(model_dir, root)
    out = llm.generate([{"prompt_token_ids": prompts["p2b"]}], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == reference["p2b"]
    assert out.num_cached_tokens == 5 * BLOCK
    stats = llm.get_stats().kv_connector
    assert stats["disk_corrupt_files"] == 1 and stats["disk_hit_tokens"] == 5 * BLOCK
    assert not bad.exists() and llm.engine.kv_cache_usage == 0.0


def test_write_behind_bound_drops_instead_of_stalling(model_dir, prompts, reference, tmp_path: Path) -> None:
    """With the disk's writes held and a one-block queue, demotions past the bound are dropped (counted, and
    forgotten by the index), the steps go on, and the tokens are unchanged."""
    llm = _llm(model_dir, tmp_path, host_blocks=2, tiered={"disk_write_queue_blocks": 1})
    connector = _connector(llm)
    release = _gate(connector.disk_io.tier, "write")
    names = ["p0a", "p1a", "p0b"]
    outs = [llm.generate([{"prompt_token_ids": prompts[n]}], GREEDY, use_tqdm=False)[0] for n in names]
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference[n] for n in names]
    stats = connector.stats()
    assert stats["disk_writes_dropped"] > 0 and stats["disk_write_queue_blocks"] == 1
    release.set()
    connector.flush()
    # Every file the index still lists is on disk: the dropped writes were forgotten.
    assert connector.stats()["disk_blocks"] == len(list(tmp_path.rglob("*.kvblock"))) > 0


def test_policies_without_parking_and_plain_int_connectors(model_dir, prompts, reference, disk_files) -> None:
    """A policy admitting through `external_prefix_hit` (it cannot park) sees a background hit as a miss; a
    connector answering a plain int (API before 1.5) still gets its hits loaded synchronously."""
    llm = _llm(model_dir, disk_files)
    scheduler = llm.engine.core.scheduler
    llm.engine.add_request("probe", {"prompt_token_ids": prompts["p0b"]}, GREEDY)
    req = scheduler.requests["probe"]
    _, num_computed = scheduler.kv.get_computed_blocks(req)  # (hashes the prompt's blocks)
    assert num_computed == 0
    assert scheduler.match_external(req, 0) == (PREFIX_BLOCKS * BLOCK, True)
    assert scheduler.external_prefix_hit(req, 0) == 0
    llm.engine.abort_request("probe")

    host_only = LLM(model_dir, kv_cache={"num_blocks": NUM_BLOCKS, "block_size": BLOCK}, num_threads=1,
                    max_num_seqs=1, kv_transfer_config={"kv_connector": "tiered"},
                    plugins={"tiered": {"host_gb": 0.01}})
    connector = _connector(host_only)
    answer = connector.get_num_new_matched_tokens
    connector.get_num_new_matched_tokens = lambda request, n: answer(request, n)[0]  # an older connector's int
    names = ["p1a", "p2a", "p1b"]
    outs = [host_only.generate([{"prompt_token_ids": prompts[n]}], GREEDY, use_tqdm=False)[0] for n in names]
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference[n] for n in names]
    # p1a's prefix: the blocks p2a evicted come from the host tier, any it left on the device from there.
    assert outs[2].num_cached_tokens == PREFIX_BLOCKS * BLOCK
    assert PREFIX_BLOCKS * BLOCK / 2 <= connector.stats()["host_hit_tokens"] <= PREFIX_BLOCKS * BLOCK
