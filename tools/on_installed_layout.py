"""Run a checker over the package laid out as it installs: `core/` as `pagedllm`, `plugins/` inside it.

`core/` and `plugins/` sit side by side in the repository but form one import package, `pagedllm` with
`pagedllm.plugins` inside it (setuptools' package-dir mapping). Tools that read a package from its folder --
import-linter, and mypy, which cannot follow setuptools' editable import hook and would otherwise see every
`pagedllm` import as missing -- need that layout on disk, so this lays it out as symlinks in a temporary
folder, puts the folder first on PYTHONPATH and MYPYPATH, and runs the command there:

    python tools/on_installed_layout.py lint-imports --no-cache      # the plugin contract (pyproject.toml)
    python tools/on_installed_layout.py mypy -p pagedllm             # types across core and plugins

The exit status is the command's. Paths in its output are relative to the temporary folder
(`pagedllm/plugins/...` is `plugins/...` in the repository, `pagedllm/...` is `core/...`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(command: list[str]) -> int:
    if not command:
        print(__doc__, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pagedllm-layout-") as tmp:
        package = Path(tmp) / "pagedllm"
        package.mkdir()
        for entry in (ROOT / "core").iterdir():
            if entry.name != "__pycache__":
                (package / entry.name).symlink_to(entry)
        (package / "plugins").symlink_to(ROOT / "plugins")
        shutil.copy(ROOT / "pyproject.toml", Path(tmp) / "pyproject.toml")  # both tools read their config here
        path = os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "MYPYPATH": tmp}
        tool = Path(sys.executable).with_name(command[0])  # the venv's copy when there is one
        return subprocess.call([str(tool) if tool.exists() else command[0], *command[1:]], cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
