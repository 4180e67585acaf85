"""Command plugins (`PluginKind.COMMAND`): a distribution's `register_commands` adds a `pagedllm` subcommand.

Third-party commands are real distributions on disk (`fake_distribution` in conftest.py), found by
`importlib.metadata`; `pagedllm bench` is pagedllm's own command plugin, registered the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm import plugin_manager
from pagedllm.cli import generate_cmd
from pagedllm.cli.main import build_parser, main
from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import PluginKind

MakeDist = Callable[..., Path]

HELLO = """
    from pagedllm.api import RegisterCommand, hookimpl

    PAGEDLLM_PLUGIN_API = ">=1.2,<2"


    def _run(args):
        print(f"hello {{args.who}}")
        return 3 if args.fail else 0


    class HelloCommand:
        @staticmethod
        def add_parser(subparsers):
            p = subparsers.add_parser({name!r}, help="say hello from a plugin")
            p.add_argument("--who", default="world")
            p.add_argument("--fail", action="store_true")
            p.set_defaults(func=_run)


    @hookimpl
    def register_commands(register: RegisterCommand) -> None:
        register({name!r}, lambda: HelloCommand, description="a third-party command")
"""


def _command_dist(make: MakeDist, dist: str, module: str, source: str) -> None:
    make(dist, {"pagedllm.commands": {module: module}}, {f"{module}.py": source}, version="1.0")


@pytest.fixture
def fresh_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pagedllm` discovers plugins through the process-wide manager: start a new one for this test."""
    monkeypatch.setattr(plugin_manager, "_default", None)


def test_bench_is_a_command_plugin_of_the_pagedllm_distribution() -> None:
    pm = PluginManager()
    spec = pm.get(PluginKind.COMMAND, "bench")
    assert spec is not None, "is the install stale? (pip install -e .)"
    assert (spec.distribution, spec.plugin) == ("pagedllm", "pagedllm.commands:bench")
    assert hasattr(spec.resolve(), "add_parser")


def test_a_third_party_command_is_added_to_pagedllm(
    fake_distribution: MakeDist, fresh_manager: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _command_dist(fake_distribution, "pagedllm-hello", "hello_cmd", HELLO.format(name="hello"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a well-formed command plugin loads silently
        parser = build_parser()
    assert "hello" in parser.format_help() and "bench" in parser.format_help()
    assert main(["hello", "--who", "plugins"]) == 0
    assert capsys.readouterr().out == "hello plugins\n"
    assert main(["hello", "--fail"]) == 3  # its func's return value is the exit status
    assert main(["plugins"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if " hello " in ln)
    assert line.split()[:3] == ["command", "hello", "pagedllm-hello"] and line.endswith("yes")


def test_a_command_clashing_with_a_built_in_is_refused_naming_its_distribution(
    fake_distribution: MakeDist, fresh_manager: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _command_dist(fake_distribution, "pagedllm-clash", "clash_cmd", HELLO.format(name="generate"))
    with pytest.warns(RuntimeWarning) as caught:
        parser = build_parser()
    (message,) = [str(w.message) for w in caught]
    assert "command 'generate'" in message and "distribution pagedllm-clash 1.0" in message
    assert "refused" in message and "`pagedllm generate` is a built-in command" in message
    # The built-in is untouched.
    assert parser.parse_args(["generate", "--prompt", "hi"]).func is generate_cmd.run


BROKEN_ADD_PARSER = """
    from pagedllm.api import hookimpl


    class HalfCommand:
        @staticmethod
        def add_parser(subparsers):
            subparsers.add_parser("half", help="half-built")
            raise RuntimeError("flags went wrong")


    class NoFunc:
        @staticmethod
        def add_parser(subparsers):
            subparsers.add_parser("nofunc")


    @hookimpl
    def register_commands(register):
        register("half", lambda: HalfCommand)
        register("nofunc", lambda: NoFunc)
        register("noload", lambda: __import__("no_such_module_for_pagedllm"))
"""


def test_a_broken_command_is_skipped_with_a_warning_and_help_still_works(
    fake_distribution: MakeDist, fresh_manager: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _command_dist(fake_distribution, "pagedllm-broken-cmd", "broken_cmd", BROKEN_ADD_PARSER)
    with pytest.warns(RuntimeWarning) as caught:
        parser = build_parser()
    messages = [str(w.message) for w in caught]
    for name, why in [("half", "RuntimeError: flags went wrong"), ("nofunc", "sets no func"),
                      ("noload", "No module named 'no_such_module_for_pagedllm'")]:
        (message,) = [m for m in messages if f"command '{name}'" in m]
        assert "distribution pagedllm-broken-cmd 1.0" in message and "skipped" in message and why in message
    help_text = parser.format_help()
    assert "bench" in help_text and "half" not in help_text and "nofunc" not in help_text  # taken back
    with pytest.warns(RuntimeWarning), pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "bench" in capsys.readouterr().out


def test_a_command_plugin_failing_to_import_does_not_break_help(
    fake_distribution: MakeDist, fresh_manager: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _command_dist(fake_distribution, "pagedllm-noimport", "noimport_cmd", "raise ImportError('needs libfoo')\n")
    with pytest.warns(RuntimeWarning, match=r"noimport_cmd.*pagedllm-noimport 1\.0.*needs libfoo"), \
            pytest.raises(SystemExit):
        main(["--help"])
    assert "bench" in capsys.readouterr().out


def test_pagedllm_help_and_bench_help_do_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom pagedllm.cli.main import main\n"
        "for argv in (['--help'], ['bench', 'throughput', '--help'], ['bench', 'serve', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'numpy', 'transformers', 'httpx') if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_PLUGINS"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout
    assert "--input-len-range" in result.stdout and "--base-url" in result.stdout
