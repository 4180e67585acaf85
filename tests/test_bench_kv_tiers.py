"""tools/bench_kv_tiers.py runs its three modes on a tiny model and writes a report that says what happened."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
from tiny_models import make_tiny_model

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_kv_tiers.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_kv_tiers", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_three_modes_one_report(tiny_root: Path, tmp_path: Path) -> None:
    model = make_tiny_model("llama", tiny_root)
    out = tmp_path / "kv.json"
    # 3 conversations x 64-token prefixes (48 blocks of 4) against a 24-block pool; ids below the tiny vocab.
    rc = _tool().main(["--model", model, "--num-threads", "1", "--num-prefixes", "3", "--prefix-len", "64",
                       "--turns", "2", "--turn-len", "8", "--max-tokens", "3", "--block-size", "4",
                       "--device-blocks", "24", "--id-low", "3", "--id-high", "384", "--disk-root", str(tmp_path),
                       # 12 blocks of 2 KiB: given, so no probe engine is built to size it
                       "--small-host-gb", str(12 * 2048 / 2**30), "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_count"] >= 1 and len(report["machine"]["date_utc"]) == 19
    modes = report["modes"]
    assert list(modes) == ["none", "host", "host+disk"]
    for res in modes.values():
        assert res["tokens_equal_none"] is True
        assert 0 < res["ttft_ms_p50"] <= res["ttft_ms_p99"] and res["total_tokens_per_s"] > 0
        assert len(res["loadavg_before"]) == 3
    assert modes["none"]["cached_fraction"] == 0.0 and modes["none"]["kv_connector"] == {}
    # Turn 2 finds each conversation's 64-token prefix and first turn in a tier: 3 x 72 of 3 x (72 + 80) tokens.
    for mode, tier in (("host", "host"), ("host+disk", "disk")):
        assert modes[mode]["cached_prompt_tokens"] == 3 * 72, mode
        assert modes[mode]["kv_connector"][f"{tier}_hit_tokens"] == 3 * 72, mode
        assert modes[mode]["tier_hit_rates"][tier] > 0.4
    assert modes["host+disk"]["kv_connector"]["disk_written_bytes"] > 0
    assert not list(tmp_path.glob("kv_tiers_*"))  # each mode's disk directory is removed


def test_refuses_a_workload_that_fits_the_device() -> None:
    with pytest.raises(SystemExit):
        _tool().main(["--num-prefixes", "2", "--prefix-len", "64", "--device-blocks", "100", "--out", "/dev/null"])
