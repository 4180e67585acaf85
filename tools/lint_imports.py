"""Run import-linter's contracts (pyproject.toml [tool.importlinter]) over the package as it is installed.

`core/` and `plugins/` sit side by side in the repository but form one import package, `pagedllm` with
`pagedllm.plugins` inside it (setuptools' package-dir mapping). import-linter reads a package's modules from
its folder, where the plugins are not, so this lays the installed layout out as symlinks in a temporary
folder and runs `lint-imports` with that folder first on the path.

    python tools/lint_imports.py        # exit status is lint-imports'
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="pagedllm-imports-") as tmp:
        package = Path(tmp) / "pagedllm"
        package.mkdir()
        for entry in (ROOT / "core").iterdir():
            if entry.name != "__pycache__":
                (package / entry.name).symlink_to(entry)
        (package / "plugins").symlink_to(ROOT / "plugins")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))}
        linter = Path(sys.executable).with_name("lint-imports")
        command = [str(linter) if linter.exists() else "lint-imports", "--no-cache", *sys.argv[1:]]
        return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
