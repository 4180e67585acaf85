"""EngineConfig from YAML/TOML files with dotted overrides; every error names the key or the file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedllm.cli.main import main
from pagedllm.config import ConfigError, EngineConfig, flat_overrides

YAML_TEXT = """\
model: ~/models/tiny
dtype: float32
scheduler:
  max_num_seqs: 8
  enable_chunked_prefill: false
kv_cache:
  block_size: 32
attention:
  backend: torch
plugins:
  my_plugin:
    knob: 3
"""

TOML_TEXT = """\
model = "~/models/tiny"
dtype = "float32"

[scheduler]
max_num_seqs = 8
enable_chunked_prefill = false

[kv_cache]
block_size = 32

[attention]
backend = "torch"

[plugins.my_plugin]
knob = 3
"""


@pytest.fixture(autouse=True)
def _no_engine_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests state exactly which environment overrides apply: drop the suite-wide ones (conftest.py)."""
    for name in list(os.environ):
        if name.startswith("PAGEDLLM_") and "__" in name:
            monkeypatch.delenv(name)


@pytest.fixture(params=[("engine.yaml", YAML_TEXT), ("engine.yml", YAML_TEXT), ("engine.toml", TOML_TEXT)],
                ids=["yaml", "yml", "toml"])
def config_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    name, text = request.param
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_and_toml_files_load_the_same_config(config_file: Path) -> None:
    cfg = EngineConfig.from_file(config_file)
    assert cfg.model == str(Path("~/models/tiny").expanduser())
    assert cfg.dtype == "float32"
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.enable_chunked_prefill) == (8, False)
    assert cfg.scheduler.name == "fcfs"  # untouched keys keep their defaults
    assert cfg.kv_cache.block_size == 32 and cfg.kv_cache.enable_prefix_caching is True
    assert cfg.attention.backend == "torch"
    assert cfg.plugins == {"my_plugin": {"knob": 3}}


def test_dotted_overrides_win_over_file_values(config_file: Path) -> None:
    cfg = EngineConfig.from_file(
        config_file, {"scheduler.max_num_seqs": 3, "kv_cache.enable_prefix_caching": False, "seed": 7}
    )
    assert cfg.scheduler.max_num_seqs == 3
    assert cfg.scheduler.enable_chunked_prefill is False  # a sibling from the file survives
    assert cfg.kv_cache.enable_prefix_caching is False and cfg.kv_cache.block_size == 32
    assert cfg.seed == 7


def test_overrides_do_not_mutate_the_input() -> None:
    data: dict[str, Any] = {"scheduler": {"max_num_seqs": 8}}
    EngineConfig.from_dict(data, {"scheduler.max_num_seqs": 2})
    assert data == {"scheduler": {"max_num_seqs": 8}}


def test_empty_files_give_the_defaults(tmp_path: Path) -> None:
    for name in ("empty.yaml", "empty.toml"):
        (tmp_path / name).write_text("")
        assert EngineConfig.from_file(tmp_path / name) == EngineConfig()


@pytest.mark.parametrize(
    ("data", "overrides", "key"),
    [
        ({"modle": "x"}, {}, "modle"),
        ({"scheduler": {"max_num_seq": 4}}, {}, "scheduler.max_num_seq"),
        ({}, {"scheduler.max_num_seq": 4}, "scheduler.max_num_seq"),
        ({}, {"kv_cache.blocksize": 4}, "kv_cache.blocksize"),
        ({"attention": {"backend": "torch", "typo": 1}}, {}, "attention.typo"),
    ],
)
def test_unknown_keys_fail_naming_the_dotted_key(data: dict[str, Any], overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(data, overrides)
    assert f"{key}: unknown key" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "key", "why"),
    [
        ({"scheduler.max_num_seqs": "many"}, "scheduler.max_num_seqs", "valid integer"),
        ({"scheduler.max_num_seqs": 0}, "scheduler.max_num_seqs", "greater than or equal to 1"),
        ({"kv_cache.gpu_memory_utilization": 1.5}, "kv_cache.gpu_memory_utilization", "less than or equal to 1"),
        ({"kv_cache.block_size": 4096}, "kv_cache.block_size", "less than or equal to 1024"),
        ({"dtype": "float8"}, "dtype", "'auto', 'float32', 'float16' or 'bfloat16'"),
        ({"scheduler.enable_chunked_prefill": "maybe"}, "scheduler.enable_chunked_prefill", "valid boolean"),
        ({"scheduler": 3}, "scheduler", "valid dictionary"),
    ],
)
def test_wrong_types_and_ranges_name_the_key(overrides: dict[str, Any], key: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({}, overrides)
    line = next(line for line in str(info.value).splitlines() if line.strip().startswith(f"{key}:"))
    assert why in line


def test_every_bad_key_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"scheduler": {"max_num_seq": 4, "max_num_seqs": -1}, "devices": "cpu"})
    message = str(info.value)
    for key in ("scheduler.max_num_seq", "scheduler.max_num_seqs", "devices"):
        assert f"  {key}:" in message


def test_override_through_a_scalar_names_the_override() -> None:
    with pytest.raises(ConfigError, match=r"override seed\.value: 'seed' is not a section"):
        EngineConfig.from_dict({"seed": 1}, {"seed.value": 2})


def test_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "engine.yaml"
    bad.write_text("scheduler:\n  max_num_seq: 4\n")
    with pytest.raises(ConfigError, match=rf"invalid {bad}:\n  scheduler\.max_num_seq: unknown key"):
        EngineConfig.from_file(bad)


def test_errors_say_when_the_bad_key_came_from_an_override_not_the_file(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("scheduler:\n  max_num_seqs: 0\n")
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_file(path, {"scheduler.max_num_seq": 4, "kv_cache": {"block_size": 0}})
    lines = str(info.value).splitlines()
    assert "  scheduler.max_num_seq: unknown key [from an override]" in lines
    assert any(line.startswith("  kv_cache.block_size:") and line.endswith("[from an override]") for line in lines)
    file_line = next(line for line in lines if line.startswith("  scheduler.max_num_seqs:"))
    assert "override" not in file_line


@pytest.mark.parametrize(
    ("name", "text"),
    [("broken.yaml", "scheduler: [1, 2\n"), ("broken.toml", "[scheduler\nmax_num_seqs = 1\n")],
)
def test_unparsable_file_names_its_path(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"config file {path} could not be parsed"):
        EngineConfig.from_file(path)


def test_non_mapping_file_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=rf"config file {path} must hold a mapping"):
        EngineConfig.from_file(path)


def test_missing_file_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"config file {path} does not exist"):
        EngineConfig.from_file(path)


def test_flat_llm_kwargs_route_to_their_sections() -> None:
    overrides = flat_overrides(max_num_seqs=4, block_size=8, enable_prefix_caching=False, load_format="auto", seed=3)
    assert overrides == {
        "scheduler.max_num_seqs": 4,
        "kv_cache.block_size": 8,
        "kv_cache.enable_prefix_caching": False,
        "seed": 3,
    }
    cfg = EngineConfig.from_dict({}, overrides)
    assert (cfg.scheduler.max_num_seqs, cfg.kv_cache.block_size, cfg.seed) == (4, 8, 3)


# -- `pagedllm config show` ---------------------------------------------------------------------------------


def test_config_show_prints_the_resolved_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(YAML_TEXT)
    argv = ["config", "show", "--config", str(path), "--set", "scheduler.max_num_seqs=3",
            "--set", "kv_cache.enable_prefix_caching=false", "--block-size", "64", "--no-prefix-caching"]
    assert main(argv) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["scheduler"]["max_num_seqs"] == 3  # --set beats the file's 8
    assert shown["scheduler"]["enable_chunked_prefill"] is False  # from the file
    assert shown["kv_cache"]["block_size"] == 64  # flag beats the file's 32
    assert shown["kv_cache"]["enable_prefix_caching"] is False
    assert shown["attention"]["backend"] == "torch"
    assert shown == EngineConfig.from_file(
        path, {"scheduler.max_num_seqs": 3, "kv_cache.block_size": 64, "kv_cache.enable_prefix_caching": False}
    ).model_dump()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--set", "scheduler.max_num_seq=3"], "scheduler.max_num_seq: unknown key"),
        (["--set", "scheduler.max_num_seqs=0"], "scheduler.max_num_seqs:"),
        (["--set", "scheduler.max_num_seqs"], "KEY=VALUE"),
        (["--config", "/nonexistent/engine.yaml"], "/nonexistent/engine.yaml does not exist"),
    ],
)
def test_config_show_with_a_bad_key_exits_2_naming_it(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", *argv]) == 2
    captured = capsys.readouterr()
    assert expected in captured.err and captured.out == ""


def test_config_show_with_a_bad_flag_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", "show", "--max-num-seqs", "lots"])
    assert info.value.code == 2
    assert "--max-num-seqs" in capsys.readouterr().err


# -- environment overrides, schema, validate, generated docs ------------------------------------------------


def test_environment_overrides_sit_between_the_file_and_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("scheduler: {max_num_seqs: 8, max_num_batched_tokens: 512}\nseed: 1\n")
    env = {"PAGEDLLM_SCHEDULER__MAX_NUM_SEQS": "4", "PAGEDLLM_SCHEDULER__MAX_NUM_BATCHED_TOKENS": "256",
           "PAGEDLLM_SEED": "5", "PAGEDLLM_PLUGINS": "a,b", "PAGEDLLM_LOG_LEVEL": "INFO",
           "PAGEDLLM_PLUGINS__BAN_TOKENS__TOKEN_IDS": "[0, 1]"}
    cfg = EngineConfig.from_file(path, {"scheduler.max_num_batched_tokens": 128}, env=env)
    assert cfg.scheduler.max_num_seqs == 4  # env beats the file
    assert cfg.scheduler.max_num_batched_tokens == 128  # the flag beats env
    assert cfg.seed == 5
    assert cfg.plugins == {"ban_tokens": {"token_ids": [0, 1]}}  # PAGEDLLM_PLUGINS itself is the allow-list


def test_a_bad_environment_override_names_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({}, env={"PAGEDLLM_SCHEDULER__MAX_NUM_SEQ": "4", "PAGEDLLM_KV_CACHE__BLOCK_SIZE": "0"})
    text = str(info.value)
    assert "scheduler.max_num_seq: unknown key [from environment PAGEDLLM_SCHEDULER__MAX_NUM_SEQ]" in text
    assert "kv_cache.block_size:" in text and "[from environment PAGEDLLM_KV_CACHE__BLOCK_SIZE]" in text


def test_environment_reaches_the_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PAGEDLLM_SCHEDULER__MAX_NUM_SEQS", "3")
    assert main(["config", "show"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["scheduler"]["max_num_seqs"] == 3
    assert main(["config", "show", "--max-num-seqs", "9"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["scheduler"]["max_num_seqs"] == 9


def test_config_show_explains_every_selection(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--model", "/nonexistent"]) == 0
    out = capsys.readouterr().out
    assert "# attention_backend: torch (highest priority that passed its checks" in out
    assert "# scheduler: fcfs (requested by config" in out
    assert "# loader: cannot select: no usable loader for '/nonexistent'" in out


def test_config_schema_is_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == EngineConfig.model_json_schema()
    assert "scheduler" in schema["properties"] and "logits_processors" in schema["properties"]


def test_config_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("scheduler: {max_num_seqs: 4}\n")
    assert main(["config", "validate", str(good)]) == 0
    assert f"{good}: valid" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("[scheduler]\nmax_num_seqs = 0\n")
    assert main(["config", "validate", str(bad)]) == 2
    assert "scheduler.max_num_seqs:" in capsys.readouterr().err


def test_plugin_sections_are_validated_by_the_plugins_model() -> None:
    from pydantic import BaseModel, ConfigDict

    from pagedllm.config import validate_plugin_sections

    class Section(BaseModel):
        model_config = ConfigDict(extra="forbid")
        alpha: float = 0.5

    cfg = EngineConfig.from_dict({"plugins": {"mine": {"alpha": 0.9}}}, env={})
    assert validate_plugin_sections(cfg, {"mine": Section})["mine"].alpha == 0.9
    cfg = EngineConfig.from_dict({"plugins": {"mine": {"alpha": "x", "beta": 1}}}, env={})
    with pytest.raises(ConfigError) as info:
        validate_plugin_sections(cfg, {"mine": Section})
    assert "plugins.mine.alpha:" in str(info.value) and "plugins.mine.beta: unknown key" in str(info.value)
    with pytest.warns(RuntimeWarning, match="plugins.mine: no installed plugin declares it"):
        validate_plugin_sections(cfg, {})


def test_checked_in_configuration_md_is_current() -> None:
    from pagedllm.cli.config_cmd import config_docs

    checked_in = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert checked_in == config_docs(), "docs/configuration.md is stale: run `pagedllm config docs -o docs/configuration.md`"
