"""Request bodies of the OpenAI Responses API (/v1/responses), in OpenAI's field names and shapes.

The same honesty as protocol.py (NOTE 1, 2 there): strict JSON types, and a field the server does not implement
is a 400 naming it. Input items accept the fields this server's own output items carry, so a client can send
`response.output` back as the next turn's input (the tool loop) without editing it; their `id` and `status`
are bookkeeping that changes nothing in the prompt.
Responses are built as plain dicts in serving_responses.py, in the shapes of `openai.types.responses`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from pagedllm.plugins.server.protocol import ModelName


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputText(_Body):
    type: Literal["input_text"]
    text: str


class OutputText(_Body):
    """An assistant message's text, as this server sent it (annotations are always empty here); its text
    goes into the prompt as input_text's does, whatever the message's role."""

    type: Literal["output_text"]
    text: str
    annotations: Annotated[list[Any], Field(max_length=0)] = []
    logprobs: list[Any] | None = None


class MessageItem(_Body):
    """A message: the short form {role, content} or the full item {type: message, id, status, ...}."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[InputText | OutputText, Field(discriminator="type")]]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    """A call the model made in an earlier turn (a `function_call` output item sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Body):
    """The client's result for a call: what the tool returned, for the model's next turn."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(_Body):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(_Body):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(_Body):
    """An earlier turn's reasoning (as this server sent it): handed to the chat template as the assistant
    turn's `reasoning_content`, which a reasoning model's template renders or drops as it was trained."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or [])


def _item_type(value: Any) -> str | None:
    # The short form of a message, {role, content}, carries no type.
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Body):
    """A function tool in the Responses shape: name and parameters at the top level, not under `function`."""

    type: Literal["function"]
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str


class FormatText(_Body):
    type: Literal["text"]


class FormatJsonObject(_Body):
    type: Literal["json_object"]


class FormatJsonSchema(_Body):
    """`text.format` json_schema: flat (name, schema, ...), where chat's response_format nests a json_schema."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(..., min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(..., alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")] | None = None


class ResponsesRequest(_Body):
    model: ModelName = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    # Echoed back on the response, as OpenAI does; nothing else reads them.
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = None
    user: str | None = None
    # No response store here: `store` may only be false, and previous_response_id is refused
    # (serving_responses.py), so a client relying on stored state hears so at once.
    store: bool | None = None
    previous_response_id: str | None = None


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """The published (OpenAPI) shape of a response: serving_responses.py builds it as a dict, item by item in
    the shapes of `openai.types.responses` (reasoning, message, function_call)."""

    id: str
    object: Literal["response"]
    created_at: float
    completed_at: float | None = None
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["disabled"]
    usage: ResponseUsage | None = None
    user: str | None = None
