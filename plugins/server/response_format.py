"""The structured-output request bodies: OpenAI's `response_format` and vLLM's `structured_outputs` field.

Models only (protocol.py declares them on both endpoints); structured_outputs.py maps them to the engine's
StructuredOutputsParams.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`."""

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    # `schema` and `json` would shadow BaseModel attributes: stored under other names, spelled as OpenAI's.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format.json_schema is only for type json_schema, not {self.type}")
        return self


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs` request field (its StructuredOutputsParams): exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None
