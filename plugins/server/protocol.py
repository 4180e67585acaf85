"""Request and response bodies of the OpenAI-compatible API (OpenAI's field names and shapes).

Constraints live on the fields, so FastAPI's validation (turned into a 400 naming the field by errors.py) and
the published OpenAPI schema agree: a client or fuzzer reading /openapi.json learns the same limits the server
enforces (tests/test_server_strict_schema.py generates requests from it).

NOTE(1) honest bodies: a field the server does not implement is a 400 naming it (`extra="forbid"`), never
accepted and dropped; the fields declared here are the allow-list: OpenAI's that we implement, plus vLLM's
documented extensions (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids,
allowed_token_ids, bad_words, prompt_logprobs, truncate_prompt_tokens, vllm_xargs, use_beam_search with
length_penalty on /v1/completions, ...).
NOTE(2) strict JSON types, as OpenAI's schema has them (`strict=True`): an integer field takes no 15.0 and no
`true`, a boolean takes no "yes", a string takes no number; a number field takes integers (JSON has one
number type).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pagedllm.plugins.server.response_format import ResponseFormat, StructuredOutputsBody


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# A token id as JSON gives it. The upper bound is the served vocabulary: checked with each request (a 400 naming
# the field) and written into the published schema by `publish_limits` (the x- marks say where).
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True})]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# OpenAI's logit_bias: token ids as (canonical) decimal strings -> a bias in [-100, 100].
LogitBiasKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$", json_schema_extra={"x-token-id-key": True})]
# The served model's name: any string here, the one name in the published schema.
ModelName = Annotated[str | None, Field(json_schema_extra={"x-served-model": True})]


def _rules(*rules: dict[str, Any]) -> dict[str, Any]:
    """Cross-field rules for the published schema (JSON Schema if/then), which validators below enforce."""
    return {"allOf": list(rules)}


_PROMPT_LOGPROBS_NOT_STREAMED = {
    "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
    "then": {"properties": {"prompt_logprobs": {"type": "null"}}},
}
# vLLM's vllm_xargs: per-request arguments for logits-processor plugins (SamplingParams.extra_args). Numbers
# are bounded to 64 bits: the request travels to the engine-core process as msgpack, which holds no wider int.
def _int64_only(value: Any) -> Any:
    """Refuse (rather than turn into a float) an integer msgpack cannot carry, in a value or inside a list."""
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, int) and not isinstance(item, bool) and not -(2**63) <= item < 2**63:
            raise ValueError(f"integer {item} does not fit in 64 bits")
    return value


# The bounds put the same limit into the published schema, where an integer and a number are both "numbers".
_XInt = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
_XNum = Annotated[float, Field(ge=-(2**63), le=2**63)]
XArgValue = Annotated[str | _XInt | _XNum | bool | list[str | _XInt | _XNum] | None, BeforeValidator(_int64_only)]


# -- errors -----------------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- shared -------------------------------------------------------------------------------------------------


class StreamOptions(_Body):
    include_usage: bool | None = False


class PromptTokensDetails(BaseModel):
    """OpenAI's usage.prompt_tokens_details: prompt tokens not computed for this request (a prefix-cache hit,
    a KV-connector tier, or KV transferred from a prefill engine)."""

    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class KVTransferParams(_Body):
    """vLLM's kv_transfer_params for disaggregated prefill (plugins/kv_connectors/pd; the router sets them):
    the prefill server keeps the prompt's KV under `transfer_id` (do_remote_decode), the decode server fetches
    it from remote_host:remote_port (do_remote_prefill)."""

    # The validator's rule in the published schema: exactly one side; the prefill side with an address.
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"properties": {"do_remote_decode": {"const": True}, "do_remote_prefill": {"const": False}},
         "required": ["do_remote_decode"]},
        {"properties": {"do_remote_prefill": {"const": True}, "do_remote_decode": {"const": False},
                        "remote_host": {"type": "string"}, "remote_port": {"type": "integer"}},
         "required": ["do_remote_prefill", "remote_host", "remote_port"]},
    ]})

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: Annotated[str, Field(min_length=1, max_length=200)]
    remote_host: NonEmptyStr | None = None
    remote_port: int | None = Field(None, ge=1, le=65535)

    @model_validator(mode="after")
    def _one_side(self) -> KVTransferParams:
        if self.do_remote_decode == self.do_remote_prefill:
            raise ValueError("exactly one of do_remote_decode and do_remote_prefill must be true")
        if self.do_remote_prefill and (self.remote_host is None or self.remote_port is None):
            raise ValueError("do_remote_prefill needs remote_host and remote_port (the prefill engine's KV server)")
        return self


class _Sampling(_Body):
    """Sampling fields common to both endpoints."""

    model: ModelName = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's end-user id, for the provider's abuse monitoring: accepted (SDKs send it), with nothing to change.
    user: str | None = None
    logit_bias: dict[LogitBiasKey, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    bad_words: list[Annotated[str, Field(pattern=r"\S")]] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    vllm_xargs: dict[str, XArgValue] | None = None
    # Disaggregated prefill (KVTransferParams); SamplingParams.extra_args["kv_transfer_params"] for the connector.
    kv_transfer_params: KVTransferParams | None = Field(None, json_schema_extra={"x-kv-transfer": True})
    # Structured outputs (structured_outputs.py): OpenAI's response_format, or vLLM's structured_outputs field.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None

    @field_validator("prompt_logprobs")
    @classmethod
    def _no_prompt_logprobs_when_streaming(cls, value: int | None, info: ValidationInfo) -> int | None:
        # As vLLM: prompt logprobs come with the whole response, which a stream never has.
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs is not available with stream=true")
        return value


# -- /v1/completions ------------------------------------------------------------------------------------------


# What beam search honours of a completion request: prompt, model, n, max_tokens, temperature,
# ignore_eos, length_penalty, include_stop_str_in_output, truncate_prompt_tokens, user. Every other field must
# keep the value that means "not asked for" (serving_beam_search.py answers a 400 naming the first that does not).
BEAM_SEARCH_NEUTRAL: dict[str, Any] = {
    "stream": False, "echo": False, "logprobs": None, "min_tokens": 0, "skip_special_tokens": True,
    **{name: None for name in (
        "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
        "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "vllm_xargs",
        "kv_transfer_params", "response_format", "structured_outputs", "stream_options",
    )},
}
_NEUTRAL_SCHEMA = {name: {"type": "null"} if value is None else {"const": value}
                   for name, value in BEAM_SEARCH_NEUTRAL.items()}
_USES_BEAM_SEARCH = {"properties": {"use_beam_search": {"const": True}}, "required": ["use_beam_search"]}
_BEAM_SEARCH_RULES: list[dict[str, Any]] = [
    {"if": _USES_BEAM_SEARCH, "then": {"properties": _NEUTRAL_SCHEMA}},
    # length_penalty only with beam search.
    {"if": {"required": ["length_penalty"], "properties": {"length_penalty": {"type": "number"}}},
     "then": _USES_BEAM_SEARCH},
]


class CompletionRequest(_Sampling):
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    # vLLM's beam-search extension (serving_beam_search.py): `n` beams (the beam width) as the choices, finished
    # beams scored cum_logprob / generated_len ** length_penalty. length_penalty means nothing without it, so it
    # is refused without it rather than ignored. (vLLM V1 dropped best_of: here an unknown field, a 400.)
    use_beam_search: bool = False
    length_penalty: float | None = Field(None, ge=-10.0, le=10.0)

    # The published schema states the cross-field rules serving_completion.py and the validators enforce.
    model_config = ConfigDict(json_schema_extra=_rules(_PROMPT_LOGPROBS_NOT_STREAMED, {
        "if": {"properties": {"echo": {"const": True}}, "required": ["echo"]},
        "then": {"properties": {"logprobs": {"type": "null"}}},
    }, *_BEAM_SEARCH_RULES))


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob, as its `prompt_logprobs` responses carry it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shape: None for the first prompt token, then {token id (as a JSON key): PromptLogprob} per position.
PromptLogprobsOut = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- /v1/chat/completions --------------------------------------------------------------------------------------


class ContentPart(_Body):
    # Text only: an image or audio part is a 400 rather than silently left out of the prompt.
    type: Literal["text"]
    text: str


class FunctionDefinition(_Body):
    # OpenAI's rule for function names.
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (an object schema); None: no parameters
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class FunctionCallIn(_Body):
    name: str
    arguments: str  # JSON text, as the server sent it


class ToolCallIn(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls (tools.py hands them to the template)
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None, ge=0, le=20,
        description="needs logprobs: true",
    )
    add_generation_prompt: bool = True
    # vLLM's extensions: extra variables for the chat template (e.g. {"enable_thinking": false}), and whether
    # to end the prompt inside the last (assistant) message so the model continues it.
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    # Tool calling (tools.py): OpenAI's fields.
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    # The published schema says it too: top_logprobs (a number) requires logprobs: true.
    model_config = ConfigDict(json_schema_extra=_rules(_PROMPT_LOGPROBS_NOT_STREAMED, {
        "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
    }))

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a call: the first carries `id`, `type` and the name; later ones `arguments` text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobsOut | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- models, tokenize --------------------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    # vLLM's: what the served name stands for (the model path); `vllm bench serve` without --model reads it.
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Body):
    # Exactly one of prompt and messages (a null one counts as absent).
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}},
    ]})

    model: ModelName = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # With messages: the tools the chat template renders, as a chat request with these tools would send them.
    tools: list[ChatTool] | None = None

    @field_validator("tools")
    @classmethod
    def _tools_need_messages(cls, value: list[ChatTool] | None, info: ValidationInfo) -> list[ChatTool] | None:
        if value is not None and info.data.get("messages") is None:
            raise ValueError("tools are rendered by the chat template: send them with messages, not prompt")
        return value


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Body):
    model: ModelName = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def publish_limits(schema: dict[str, Any], vocab_size: int, model_name: str,
                   kv_connector: bool = False) -> dict[str, Any]:
    """The OpenAPI schema with this server's own limits written in where the fields are marked: token ids
    below the vocabulary size, logit_bias keys likewise, `model` the served name, `kv_transfer_params` null
    only without a KV connector. So /openapi.json describes exactly what this server accepts, model-specific
    bounds included (a fuzzer's valid case is valid here)."""
    key_pattern = _decimal_below(vocab_size)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.pop("x-token-id", False):
                node["maximum"] = vocab_size - 1
            if node.pop("x-token-id-key", False):
                node["pattern"] = key_pattern
            if node.pop("x-served-model", False):
                node["enum"] = [model_name, None]
            if node.pop("x-kv-transfer", False) and not kv_connector:
                node.clear()
                node["type"] = "null"  # refused with a 400 naming it (serving_common.sampling_params)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _decimal_below(n: int) -> str:
    """A regex matching the canonical decimals 0 .. n - 1 (n >= 1): shorter numbers, then digit by digit."""
    top = str(n - 1)
    k = len(top)
    alternatives = ["0"] if k > 1 else [f"[0-{top}]"]
    if k > 1:
        alternatives.append(f"[1-9][0-9]{{0,{k - 2}}}")
        for i, digit in enumerate(top):
            low, high = (1 if i == 0 else 0), int(digit) - 1
            if high >= low:
                alternatives.append(f"{top[:i]}[{low}-{high}][0-9]{{{k - i - 1}}}")
        alternatives.append(top)
    return "^(" + "|".join(alternatives) + ")$"


def prompt_logprobs_out(positions: list[Any] | None) -> PromptLogprobsOut | None:
    """RequestOutput.prompt_logprobs (None, then {token id: Logprob} per position) in vLLM's JSON shape."""
    if positions is None:
        return None
    return [
        None if pos is None else {
            str(tid): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in pos.items()
        }
        for pos in positions
    ]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
