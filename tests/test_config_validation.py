"""Config keys that name plugin components are checked against plugin discovery, by name only.

`pagedllm config validate` and every engine-building command report each unknown name with its dotted key,
the names available and a "did you mean" for a near miss, as one line per problem with exit status 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedllm import hookimpl
from pagedllm.cli.main import main
from pagedllm.component_names import (
    COMPONENT_KEYS,
    ComponentNameError,
    check_component_names,
    component_name_problems,
)
from pagedllm.config import ConfigError, EngineConfig
from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import PluginKind
from pagedllm.selector import SelectionError, select

# (config, dotted key, bad value, a name that is available, the suggestion or None when nothing is close)
MISSPELLINGS = [
    ({"attention": {"backend": "flashattention"}}, "attention.backend", "flashattention", "torch", "flash_attn"),
    ({"scheduler": {"name": "priority"}}, "scheduler.name", "priority", "fcfs", None),
    ({"loader": {"name": "safetensorz"}}, "loader.name", "safetensorz", "hf", None),
    ({"loader": {"name": "gguff"}}, "loader.name", "gguff", "hf", "gguf"),
    ({"quantization": {"method": "fp9"}}, "quantization.method", "fp9", "none", "fp8"),
    ({"parallel": {"executor": "multiprocess"}}, "parallel.executor", "multiprocess", "uniproc", "multiproc"),
    ({"speculative": {"method": "ngrams"}}, "speculative.method", "ngrams", "draft", "ngram"),
    ({"speculative": {"draft_load_format": "HF"}}, "speculative.draft_load_format", "HF", "gguf", "hf"),
]
ALL_BAD = {
    "attention": {"backend": "flashattention"},
    "scheduler": {"name": "priority"},
    "loader": {"name": "safetensorz"},
}


def _config(data: dict[str, Any]) -> EngineConfig:
    return EngineConfig.from_dict(data, env={})


def _write(tmp_path: Path, data: dict[str, Any], name: str = "engine.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("data", "key", "bad", "available", "suggestion"), MISSPELLINGS,
                         ids=[m[1] + "=" + m[2] for m in MISSPELLINGS])
def test_an_unknown_component_name_is_an_error_naming_key_value_names_and_suggestion(
    data: dict[str, Any], key: str, bad: str, available: str, suggestion: str | None
) -> None:
    with pytest.raises(ComponentNameError) as info:
        check_component_names(_config(data), source="engine.yaml")
    assert len(info.value.problems) == 1
    line = info.value.problems[0]
    assert line.startswith(f"{key}: ") and f"'{bad}'" in line
    assert "available: " in line and available in line.split("available: ", 1)[1]
    if suggestion is None:
        assert "did you mean" not in line
    else:
        assert line.endswith(f"did you mean '{suggestion}'?")
    assert str(info.value).startswith("invalid engine.yaml:\n  ")


def test_every_unknown_name_is_reported_not_only_the_first() -> None:
    problems = component_name_problems(_config({**ALL_BAD, "speculative": {"method": "ngrams"}}))
    assert [p.split(":", 1)[0] for p in problems] == [
        "attention.backend", "scheduler.name", "loader.name", "speculative.method"
    ]


def test_choose_for_me_values_and_registered_names_pass() -> None:
    check_component_names(_config({}))  # every key at its default: None, or scheduler.name 'fcfs'
    check_component_names(_config({"quantization": {"method": ""}}))  # the builder reads '' as unset too
    check_component_names(_config({
        "attention": {"backend": "torch"}, "loader": {"name": "dummy"}, "quantization": {"method": "none"},
        "parallel": {"executor": "uniproc"}, "speculative": {"method": "ngram", "draft_load_format": "hf"},
    }))


def test_every_component_key_is_a_config_field() -> None:
    # A renamed field would otherwise turn its check into an AttributeError at validation time.
    from pagedllm.component_names import _named_values

    cfg = _config({})
    for key in COMPONENT_KEYS:
        _named_values(cfg, key)


class _BanTokens:
    @hookimpl
    def register_logits_processors(self, register: Any) -> None:
        register("ban_tokens", lambda: object)


def test_each_logits_processor_is_checked_by_its_index() -> None:
    pm = PluginManager()
    pm.register(_BanTokens(), name="ban-tokens", distribution="pagedllm-fake", version="0.1")
    cfg = _config({"logits_processors": ["ban_tokens", "ban_token"]})
    problems = component_name_problems(cfg, pm)
    assert len(problems) == 1
    assert problems[0].startswith("logits_processors[1]: no logits_processor named 'ban_token'; available: ban_tokens")
    assert problems[0].endswith("did you mean 'ban_tokens'?")


def test_the_selector_suggests_a_close_name_too() -> None:
    from pagedllm.plugin_manager import get_plugin_manager

    with pytest.raises(SelectionError, match=r"no scheduler named 'fcsf'; available: fcfs.*did you mean 'fcfs'\?$"):
        select(get_plugin_manager(), PluginKind.SCHEDULER, None, requested="fcsf")


# -- the command line ------------------------------------------------------------------------------------------


def test_config_validate_reports_every_bad_name_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, ALL_BAD)
    assert main(["config", "validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert "valid" not in captured.out and "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert lines[0] == f"pagedllm: error: invalid {path}:"
    assert lines[1].startswith("  attention.backend: no attention_backend named 'flashattention'; available: ")
    assert lines[1].endswith("did you mean 'flash_attn'?")
    assert lines[2].startswith("  scheduler.name: no scheduler named 'priority'; available: fcfs")
    assert lines[3].startswith("  loader.name: no loader named 'safetensorz'; available: dummy, gguf, hf")
    assert len(lines) == 4


def test_config_validate_still_says_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"attention": {"backend": "torch"}, "scheduler": {"name": "fcfs"},
                             "loader": {"name": "hf"}, "quantization": {"method": "none"}})
    assert main(["config", "validate", str(path)]) == 0
    assert capsys.readouterr().out.strip() == f"{path}: valid"


@pytest.mark.parametrize("command", [["generate"], ["chat"], ["serve"], ["bench", "latency"],
                                     ["bench", "throughput"], ["config", "show"]], ids=" ".join)
def test_engine_commands_check_names_first_and_print_one_line(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedllm.cli import chat_cmd, generate_cmd, serve_cmd
    from pagedllm.plugins.commands.bench import cli as bench_cli

    def reached(args: Any) -> int:
        raise AssertionError("the command ran: its config was not checked before dispatch")

    # Were the check missing, these would load a model or start a server; `config show` is light, so it runs.
    for module, name in [(generate_cmd, "run"), (chat_cmd, "run"), (serve_cmd, "run"),
                         (bench_cli, "_run_latency"), (bench_cli, "_run_throughput")]:
        monkeypatch.setattr(module, name, reached)
    path = _write(tmp_path, {"scheduler": {"name": "priority"}})
    assert main([*command, "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"pagedllm: error: invalid {path}: scheduler.name: no scheduler named 'priority'; available: fcfs; "
        "no installed plugin registers it (is the package that provides it installed? `pagedllm plugins` "
        "lists every scheduler)"
    ]


def test_a_flag_is_checked_like_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--distributed-executor-backend", "rey"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedllm: error: invalid config: parallel.executor: no executor named 'rey'")
    assert err.rstrip().endswith("did you mean 'ray'?") and len(err.splitlines()) == 1


def test_a_single_config_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--set", "scheduler.max_num_seqs=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedllm: error: invalid config: scheduler.max_num_seqs: ")
    assert len(err.splitlines()) == 1


def test_a_selection_failure_at_run_time_is_one_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedllm.cli import config_cmd

    def fail(cfg: EngineConfig) -> str:
        raise SelectionError("attention_backend 'flash_attn' (from pagedllm) was requested but cannot be used: "
                             "needs a CUDA device, not cpu")

    monkeypatch.setattr(config_cmd, "preview_selections", fail)
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "pagedllm: error: attention_backend 'flash_attn' (from pagedllm) was requested but cannot be used: "
        "needs a CUDA device, not cpu"
    ]


def test_an_internal_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.cli import config_cmd

    def bug(cfg: EngineConfig) -> str:
        raise KeyError("a bug, not the user's config")

    monkeypatch.setattr(config_cmd, "preview_selections", bug)
    with pytest.raises(KeyError):
        main(["config", "show"])


def test_component_name_error_is_a_config_error() -> None:
    # Callers that already handle ConfigError (LLM users, the server) need no new except clause.
    assert issubclass(ComponentNameError, ConfigError)


# -- no heavy imports --------------------------------------------------------------------------------------------


def test_validation_and_the_engine_commands_preflight_do_not_import_torch(tmp_path: Path) -> None:
    path = _write(tmp_path, ALL_BAD)
    code = (
        "import sys\n"
        "from pagedllm.cli.main import main\n"
        f"assert main(['config', 'validate', {str(path)!r}]) == 2\n"
        f"assert main(['generate', '--config', {str(path)!r}]) == 2\n"
        "from pagedllm.component_names import component_name_problems\nfrom pagedllm.config import EngineConfig\n"
        f"assert len(component_name_problems(EngineConfig.from_dict({ALL_BAD!r}))) == 3\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'triton', 'numpy') if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout
    assert "pagedllm: error: invalid" in result.stderr
