"""A stack of KV connectors (`kv_transfer.kv_connector: [first, second]`, core/kv_cache/connector_stack.py): every
connector hears every eviction, a prefix hit comes from the connector holding the longest (the earlier in the
list on a tie), and greedy tokens equal transformers'.

The first connector is the plugin starter's in-memory store (`pagedllm plugin new kv_connector`), registered
in-process and capped at a few blocks; the second is `tiered` with a host tier that holds everything. The
device pool keeps no prefix between the requests that share it (as in test_kv_connector_tiers.py).
"""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from tiny_models import hf_greedy, make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.cli.main import main
from pagedllm.config import ConfigError, EngineConfig
from pagedllm.plugin_manager import get_plugin_manager

BLOCK = 4
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
NUM_BLOCKS = 20  # one request holds 15 blocks: no prefix survives on the device until its next request
STORE_BLOCKS = 14  # the first connector holds one 12-block prefix (and a little more), the second all four


@pytest.fixture(scope="module")
def model_dir(tiny_root: Path) -> str:
    return make_tiny_model("llama", tiny_root)


@pytest.fixture(scope="module")
def workload() -> list[list[int]]:
    """Prefixes A, B, C of 12 blocks in the order A B A C B, each with its own suffix: the second A follows
    A's eviction directly (the small store still holds all of it), the second B comes after the store has
    dropped most of B (it keeps a few of B's leading blocks: a shorter hit than tiered's)."""
    rng = random.Random(7)
    a, b, c = ([rng.randrange(3, 384) for _ in range(12 * BLOCK)] for _ in range(3))
    return [p + [rng.randrange(3, 384) for _ in range(5)] for p in (a, b, a, c, b)]


@pytest.fixture(scope="module")
def memstore(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The starter's connector package, generated and registered with this process's plugin manager."""
    root = tmp_path_factory.mktemp("memstore")
    assert main(["plugin", "new", "kv_connector", "memstore", str(root)]) == 0
    sys.path.insert(0, str(root / "src"))
    pm = get_plugin_manager()
    try:
        pm.register(importlib.import_module("pagedllm_memstore"), name="memstore", distribution="tests")
        yield "memstore"
    finally:
        pm.unregister("memstore")
        sys.path.remove(str(root / "src"))


def _llm(model_dir: str, connectors: list[str], **sections: Any) -> LLM:
    return LLM(model_dir, kv_cache={"num_blocks": NUM_BLOCKS, "block_size": BLOCK}, max_num_seqs=1, num_threads=1,
               kv_transfer_config={"kv_connector": connectors}, plugins=sections)


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    tokens, cached = [], []
    for p in prompts:
        out = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0]
        tokens.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens)
    return tokens, cached


def test_the_longest_hit_serves_the_request_and_no_token_changes(model_dir, workload, memstore) -> None:
    reference = [ids for ids, _ in hf_greedy(model_dir, workload, MAX_TOKENS)]
    llm = _llm(model_dir, [memstore, "tiered"], memstore={"max_blocks": STORE_BLOCKS}, tiered={"host_gb": 0.5})
    tokens, cached = _run(llm, workload)
    assert tokens == reference
    stats = llm.get_stats().kv_connector
    # The second A and the second B: the whole 12-block prefix came from the device and the connectors, A's
    # from the store (first in the list, a tie with tiered: what the device pool had not kept), B's all from
    # tiered (the store's hit on B is shorter).
    assert (cached[2], cached[4]) == (12 * BLOCK, 12 * BLOCK)
    from_store = stats["hit_tokens"]
    assert 0 < from_store <= 12 * BLOCK and stats["host_hit_tokens"] == 12 * BLOCK
    selections = llm.engine.parts.selections
    assert (selections["kv_connector[0]"].winner.name, selections["kv_connector[1]"].winner.name) == (
        memstore, "tiered")
    assert llm.engine.kv_cache_usage == 0.0

    # On a tie the order decides: with tiered first (it holds everything) the store never serves a hit.
    swapped = _llm(model_dir, ["tiered", memstore], memstore={"max_blocks": STORE_BLOCKS}, tiered={"host_gb": 0.5})
    tokens, cached = _run(swapped, workload)
    assert tokens == reference and (cached[2], cached[4]) == (12 * BLOCK, 12 * BLOCK)
    stats = swapped.get_stats().kv_connector
    assert stats["hit_tokens"] == 0 and stats["host_hit_tokens"] == from_store + 12 * BLOCK


@pytest.mark.parametrize(("value", "match"), [
    ([], "an empty list names no connector"),
    (["tiered", "tiered"], "lists tiered more than once"),
])
def test_a_bad_stack_is_refused_naming_the_key(value: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=rf"kv_transfer\.kv_connector: .*{match}"):
        EngineConfig.from_dict({"kv_transfer": {"kv_connector": value}})
