"""pagedllm.api.structured_output: What a structured-output backend plugin builds on: its context, the grammar and backend protocols, the request's constraint and backend-neutral views of it.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.protocols.structured_output import (
    StructuredOutputBackend,
    StructuredOutputContext,
    StructuredOutputGrammar,
)
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.constraints import choice_as_ebnf, choice_as_lark, constraint_key, json_schema

__all__ = [
    "StructuredOutputBackend",
    "StructuredOutputContext",
    "StructuredOutputGrammar",
    "StructuredOutputsParams",
    "choice_as_ebnf",
    "choice_as_lark",
    "constraint_key",
    "json_schema",
]
