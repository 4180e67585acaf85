"""docs/plugins/tutorial.md, executed: its marked blocks run in order, so the tutorial cannot rot.

The conventions are documented in the HTML comment at the top of the tutorial: ```bash tutorial``` blocks
run, ```text tutorial output``` blocks must appear in the previous command's output, ```LANG tutorial
expect=PATH``` blocks must equal that file and ```LANG tutorial write=PATH``` blocks are written to it.

The commands run as a reader types them (`pip install -e ./pagedllm-spf`, `pagedllm ...`, `pytest ...`), in a
throwaway virtual environment: it sees this interpreter's packages (pagedllm, torch, pytest: nothing is
downloaded) and has its own `pip`, `pagedllm` and `pytest` scripts, so what pip installs lands there, never
in the shared environment. pip is kept offline through its environment variables.
"""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "plugins" / "tutorial.md"
_FENCE = re.compile(r"^```(.*)$")
_SCRIPTS = ("pip", "pagedllm", "pytest")  # the console scripts the tutorial's commands call


class TutorialError(AssertionError):
    """A block of the tutorial failed; the message names its line and says how."""


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    action: str  # "run", "output", "expect" or "write"
    path: str | None
    text: str  # the body, ending with a newline


def parse(markdown: str) -> list[Block]:
    """The tutorial blocks, in order. A block marked `tutorial` with an unknown action is an error, so a typo
    in an info string cannot silently turn a checked block into an illustration."""
    blocks: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start, words = i, match.group(1).split()
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise TutorialError(f"line {start + 1}: code block is never closed")
        i += 1
        if "tutorial" not in words[1:2]:
            continue  # illustration only
        blocks.append(_block(start + 1, words, "".join(f"{line}\n" for line in body)))
    return blocks


def _block(line: int, words: list[str], text: str) -> Block:
    lang, extra = words[0], words[2:]
    if lang == "bash" and not extra:
        return Block(line, lang, "run", None, text)
    if extra == ["output"]:
        return Block(line, lang, "output", None, text)
    if len(extra) == 1 and extra[0].split("=", 1)[0] in ("expect", "write") and "=" in extra[0]:
        action, path = extra[0].split("=", 1)
        return Block(line, lang, action, path, text)
    raise TutorialError(f"line {line}: unknown tutorial block ```{' '.join(words)}")


def run(blocks: list[Block], workdir: Path, env: dict[str, str], timeout: float = 300) -> None:
    """Execute `blocks` in `workdir`; raise TutorialError at the first that fails."""
    output: str | None = None
    for block in blocks:
        where = f"tutorial line {block.line}"
        if block.action == "run":
            result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=workdir, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
            output = result.stdout
            if result.returncode != 0:
                raise TutorialError(f"{where}: exit status {result.returncode}:\n{block.text}\n{output}")
        elif block.action == "output":
            if output is None:
                raise TutorialError(f"{where}: an output block must follow a bash block")
            missing = [line for line in block.text.splitlines() if line.strip() and line.strip() not in output]
            if missing:
                raise TutorialError(f"{where}: not in the command's output: {missing}\noutput:\n{output}")
        else:
            assert block.path is not None
            path = workdir / block.path
            if block.action == "write":
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(block.text)
            elif not path.is_file():
                raise TutorialError(f"{where}: {block.path} does not exist")
            elif path.read_text() != block.text:
                raise TutorialError(f"{where}: {block.path} differs from the tutorial:\n{_diff(block.text, path)}")


def _diff(text: str, path: Path) -> str:
    import difflib

    return "".join(difflib.unified_diff(text.splitlines(True), path.read_text().splitlines(True), "tutorial", str(path)))


def make_sandbox(root: Path) -> dict[str, str]:
    """A virtual environment seeing this interpreter's packages, with its own console scripts; its env."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    (purelib,) = (venv / "lib").glob("python3*/site-packages")
    # --system-site-packages shows the base interpreter's packages; this .pth adds the ones of the environment
    # the tests run in (where pagedllm is installed), as tests/test_packaging.py does.
    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    (purelib / "_outer_env.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    for name in _SCRIPTS:  # the same scripts, run by the sandbox's interpreter
        script = Path(sys.executable).parent / name
        body = script.read_text().split("\n", 1)[1]
        (venv / "bin" / name).write_text(f"#!{venv / 'bin' / 'python'}\n{body}")
        (venv / "bin" / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PAGEDLLM_PLUGINS", "PYTHONHOME")}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), HF_HUB_OFFLINE="1",
        # Offline pip: no index, and build with the setuptools already installed (pip spells "no build
        # isolation" as PIP_NO_BUILD_ISOLATION=0).
        PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    return env


def _default_model_or_skip() -> None:
    from pagedllm.default_model import default_model_path

    try:
        default_model_path()
    except Exception as exc:  # the tutorial's `pagedllm generate` runs the embedded default model
        pytest.skip(str(exc))


# -- the tutorial ---------------------------------------------------------------------------------------------


def test_the_tutorial_runs_as_written(tmp_path: Path) -> None:
    _default_model_or_skip()
    blocks = parse(TUTORIAL.read_text())
    env = make_sandbox(tmp_path)
    workdir = tmp_path / "work"
    workdir.mkdir()
    run(blocks, workdir, env)
    # Whatever the blocks did, the shared environment never got the package.
    assert subprocess.run([sys.executable, "-c", "import pagedllm_spf"], capture_output=True).returncode != 0


def test_the_tutorial_documents_its_conventions_and_checks_the_starter() -> None:
    text = TUTORIAL.read_text()
    assert text.startswith("<!--") and "tests/test_tutorial.py" in text.split("-->")[0]
    blocks = parse(text)
    actions = [b.action for b in blocks]
    assert actions[0] == "run" and "pagedllm plugin new scheduler spf" in blocks[0].text
    shown = {b.path for b in blocks if b.action == "expect"}
    assert {"pagedllm-spf/pyproject.toml", "pagedllm-spf/src/pagedllm_spf/__init__.py",
            "pagedllm-spf/src/pagedllm_spf/scheduler.py", "pagedllm-spf/tests/test_spf.py"} <= shown
    assert actions.count("write") >= 1 and actions[-2:] == ["run", "output"]  # the change, then its tests
    # No elided code: every file it shows is whole.
    assert not [b.line for b in blocks if b.action in ("expect", "write") and re.search(r"^\s*\.\.\.\s*$", b.text, re.M)]


# -- the runner can fail ------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ}


def test_a_failing_command_fails_naming_its_line(tmp_path: Path) -> None:
    doc = "intro\n\n```bash tutorial\necho one\nfalse\necho after-false\n```\n"
    with pytest.raises(TutorialError, match=r"tutorial line 3: exit status 1") as info:
        run(parse(doc), tmp_path, _env())
    assert str(info.value).count("after-false") == 1  # in the block's text, not its output: set -e stopped
    # A pipeline fails when any part fails, not only its last.
    with pytest.raises(TutorialError, match="exit status 1"):
        run(parse("```bash tutorial\nfalse | cat\n```\n"), tmp_path, _env())


def test_output_expect_and_write_blocks_check_what_they_say(tmp_path: Path) -> None:
    good = ("```bash tutorial\nmkdir -p pkg && printf 'a = 1\\n' > pkg/m.py && echo 'made pkg/m.py'\n```\n"
            "```text tutorial output\nmade pkg/m.py\n```\n"
            "```python tutorial expect=pkg/m.py\na = 1\n```\n"
            "```python tutorial write=pkg/m.py\na = 2\n```\n"
            "```bash tutorial\ngrep -q 'a = 2' pkg/m.py\n```\n")
    broken = {
        r"not in the command's output: \['made pkg/n.py'\]": good.replace("output\nmade pkg/m.py", "output\nmade pkg/n.py"),
        "pkg/m.py differs from the tutorial": good.replace("expect=pkg/m.py\na = 1", "expect=pkg/m.py\na = 3"),
        "pkg/x.py does not exist": good.replace("expect=pkg/m.py", "expect=pkg/x.py"),
        "tutorial line 13: exit status 1": good.replace("write=pkg/m.py\na = 2", "write=pkg/m.py\na = 4"),
        "an output block must follow a bash block": "```text tutorial output\nanything\n```\n",
    }
    run(parse(good), tmp_path, _env())
    for i, (why, doc) in enumerate(broken.items()):
        (tmp_path / str(i)).mkdir()
        with pytest.raises(TutorialError, match=why):
            run(parse(doc), tmp_path / str(i), _env())


def test_a_mistyped_or_unclosed_block_is_an_error_not_an_illustration() -> None:
    with pytest.raises(TutorialError, match=r"line 1: unknown tutorial block ```python tutorial expct=a.py"):
        parse("```python tutorial expct=a.py\nx = 1\n```\n")
    with pytest.raises(TutorialError, match="never closed"):
        parse("```bash tutorial\necho hi\n")
    assert parse("```python\nnot run\n```\n```text\nnor this\n```\n") == []


def test_the_sandbox_keeps_pip_away_from_the_shared_environment(tmp_path: Path) -> None:
    env = make_sandbox(tmp_path)
    # The commands resolve to the sandbox's scripts, and what pip installs goes to the sandbox's site-packages.
    probe = "command -v pip pagedllm pytest; python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'"
    found = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert len(found) == 4 and all(f.startswith(str(tmp_path / "venv")) for f in found), found
    # ...while pagedllm, from this environment, still imports there.
    subprocess.run(["python", "-c", "import pagedllm.cli.plugin_cmd"], env=env, check=True)
