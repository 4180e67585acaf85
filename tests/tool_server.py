"""A live server on the tiny tool model (tool_models.py), steered by `force_text`, for the tool-calling and
Responses API tests; and the mark for tests that need a structured-output backend to enforce a grammar.

No tests here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_server_support import LiveServer, live_server
from tool_models import FORCED_TEXT, make_tokenizer, make_tool_model, write_force_text_plugin

MODEL = "tiny-tools"  # the served model name


def structured_backend() -> bool:
    from pagedllm.api import PluginKind
    from pagedllm.api.engine import get_plugin_manager

    return any(not c.missing_requirements() for c in get_plugin_manager().components(PluginKind.STRUCTURED_OUTPUT))


needs_structured = pytest.mark.skipif(not structured_backend(),
                                      reason="no structured_output backend registered: the grammar is not enforced")


@contextmanager
def tool_model_server(root: Path, args: list[str], env: dict[str, str] | None = None) -> Iterator[LiveServer]:
    """`pagedllm serve` on a fresh tiny tool model under `root`, with the deepseek_r1 reasoning parser and
    every unconstrained request forced to FORCED_TEXT; `args` are the further serve flags."""
    model = make_tool_model(root)
    site = root / "site"
    site.mkdir()
    write_force_text_plugin(site)
    tok = make_tokenizer()
    config = {
        "model": model, "max_model_len": 2048, "logits_processors": ["force_text"],
        "plugins": {"force_text": {"token_ids": tok(FORCED_TEXT, add_special_tokens=False).input_ids,
                                   "eos_token_id": tok.eos_token_id},
                    "openai": {"reasoning_parser": "deepseek_r1"}},
    }
    (root / "engine.json").write_text(json.dumps(config))
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    for key, value in (env or {}).items():
        mp.setenv(key, value)
    try:
        with live_server(["--config", str(root / "engine.json"), "--served-model-name", MODEL, *args],
                         str(root / "server.log")) as srv:
            yield srv
    finally:
        mp.undo()
