"""Rewrite the name lists of docs/plugins/api.md from what pagedllm.api and its submodules export.

Each `### \`pagedllm.api...\`` section of the page ends with one line listing the module's `__all__`;
tests/test_api_surface.py fails when that line and the exports differ. After changing the API, run

    python tools/api_names.py

and review the diff (a removed name is a major-version change: docs/plugins/api.md, "Versions").
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins" / "api.md"


def main() -> int:
    text = DOC.read_text()
    sections = re.findall(r"^### `(pagedllm\.api[\w.]*)`", text, flags=re.M)
    for name in sections:
        module = importlib.import_module(name)
        names = ", ".join(f"`{n}`" for n in sorted(module.__all__))
        pattern = r"(### `" + re.escape(name) + r"`\n\n(?:[^\n]*\n\n)?)`[^\n]*\n"
        text, count = re.subn(pattern, lambda m: m.group(1) + names + "\n", text)
        if count != 1:
            print(f"{DOC}: no name line under {name}", file=sys.stderr)
            return 1
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
