"""The config's `plugins.openai` section: the server's settings a config file can give (light: pydantic only).

Registered as the `openai` entrypoint's config model, so a typo in the section is an error naming the key.
The `pagedllm serve` flags of the same names win over it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ServerSection(BaseModel):
    """The config's `plugins.openai` section: the `openai` entrypoint's settings that the flags also give."""

    model_config = ConfigDict(extra="forbid")

    tool_call_parser: str | None = Field(None, description="tool parser plugin name (hermes, llama3_json, ...)")
    reasoning_parser: str | None = Field(None, description="reasoning parser plugin name (deepseek_r1, qwen3)")
    enable_auto_tool_choice: bool = Field(False, description='allow tool_choice "auto" (needs tool_call_parser)')
    ui: bool = Field(True, description="serve the web chat and engine dashboard at / (--no-ui: false)")

    @classmethod
    def resolve_ui(cls, options: Any, section: dict[str, Any] | None) -> bool:
        """The `--no-ui` flag (ServeOptions.ui False; None when not given) over the section's `ui`."""
        flag = getattr(options, "ui", None)
        return cls.model_validate(section or {}).ui if flag is None else bool(flag)
