"""pagedllm.api.cli: What a command plugin declares its flags with: the engine's command-line flags and the config they describe.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION. Light (no torch): a command's
flag-declaring module imports it while `pagedllm --help` builds its parser.
"""

from __future__ import annotations

from pagedllm.cli.engine_args import add_engine_args, engine_config_from_args

__all__ = [
    "add_engine_args",
    "engine_config_from_args",
]
