"""Messages between the API process and the engine-core process, framed with msgpack (msgspec), never pickle.

    API process                                     engine-core process
    ───────────                                     ───────────────────
    AddRequest(s) / Abort / Shutdown  ── PUSH ──────▶  PULL   (input socket)
    Ready / Outputs / Fatal        ◀─ PULL ──────── PUSH   (output socket)

Every message is a tagged msgspec Struct, so one typed decoder per direction rejects anything malformed
instead of executing it (pickle would run whatever the peer sent). The engine's own dataclasses
(EngineCoreOutput, LogprobsEntry, SchedulerStats) travel as they are: msgspec encodes dataclasses natively.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from pagedllm.engine.engine_watch import EngineSnapshot
from pagedllm.engine.messages import EngineCoreOutput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.sched.stats import SchedulerStats

# -- API process -> engine core ---------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    """One engine-core sequence (one sample of a request; n > 1 is fanned out by the frontend)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields, see params_to_dict
    arrival_time: float
    priority: int = 0
    eos_token_id: int | None = None
    encoder_prompt_token_ids: list[int] | None = None  # encoder-decoder models only


class AddRequests(msgspec.Struct, tag="adds"):
    """Several AddRequests that must enter the same step: the prompts and samples of one API request (the
    client gathers what was added in one event-loop turn; core_client.py NOTE 2)."""

    requests: list[AddRequest]


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Watch(msgspec.Struct, tag="watch"):
    """Attach an EngineSnapshot (engine_watch.py) to Outputs at most every `interval_s`; 0 stops it."""

    interval_s: float


# -- engine core -> API process ---------------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready"):
    """Sent once, after the engine is built: what the frontend needs to validate requests."""

    pid: int
    model_name: str
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int
    num_blocks: int
    block_size: int
    # The core's resolved scheduler.max_num_seqs (on the CPU sized from the machine when unset:
    # platform/cpu_sizing.py); 0 = the frontend's config says it (a data-parallel router).
    max_num_seqs: int = 0


class Outputs(msgspec.Struct, tag="outputs"):
    """One step's outputs (possibly none) plus the scheduler's numbers after it; also the idle heartbeat."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
    snapshot: EngineSnapshot | None = None  # only while the API process asked for them (Watch)


class Fatal(msgspec.Struct, tag="fatal"):
    """The engine core failed (while building, or in a step) and is exiting."""

    message: str


ToCore = AddRequest | AddRequests | Abort | Shutdown | Watch
FromCore = Ready | Outputs | Fatal

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(msg: ToCore | FromCore) -> bytes:
    return _encoder.encode(msg)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)


# -- SamplingParams and Request ----------------------------------------------------------------------------

_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")]


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """Plain fields plus the engine-filled stop ids (a private field msgspec would otherwise skip)."""
    out = {name: getattr(params, name) for name in _PARAM_FIELDS}
    out["all_stop_token_ids"] = sorted(params.all_stop_token_ids)
    out["min_tokens_stop_ids"] = sorted(params.min_tokens_stop_ids)
    out["bad_words_token_ids"] = params.bad_words_token_ids
    return out


def params_from_dict(data: dict[str, Any]) -> SamplingParams:
    data = dict(data)
    stop_ids = data.pop("all_stop_token_ids", [])
    min_tokens_ids = data.pop("min_tokens_stop_ids", [])
    bad_words_ids = data.pop("bad_words_token_ids", [])
    structured = data.get("structured_outputs")
    if isinstance(structured, dict):  # msgpack carried the dataclass as its fields
        data["structured_outputs"] = StructuredOutputsParams(**structured)
    params = SamplingParams(**{k: v for k, v in data.items() if k in _PARAM_FIELDS})
    params._all_stop_token_ids = set(stop_ids)
    params._min_tokens_stop_ids = set(min_tokens_ids)
    params._bad_words_token_ids = [list(ids) for ids in bad_words_ids]
    return params


def make_add_request(request: Request) -> AddRequest:
    return AddRequest(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        params=params_to_dict(request.sampling_params),
        arrival_time=request.arrival_time,
        priority=request.priority,
        eos_token_id=request.eos_token_id,
        encoder_prompt_token_ids=request.encoder_prompt_token_ids,
    )


def request_from_message(msg: AddRequest) -> Request:
    # NOTE: arrival times are monotonic clocks of another process; the core only uses them for ordering,
    # so they are re-stamped here rather than compared across processes.
    return Request(
        msg.request_id,
        msg.prompt_token_ids,
        params_from_dict(msg.params),
        eos_token_id=msg.eos_token_id,
        priority=msg.priority,
        encoder_prompt_token_ids=msg.encoder_prompt_token_ids,
    )
