"""Token-level stop rules applied in the engine core (stop *strings* are the detokenizer's job)."""

from __future__ import annotations

from pagedllm.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status if its last token ends it; return whether it did."""
    # Runs for every sampled token: lengths and params are read directly rather than through the properties.
    params = request.sampling_params
    outputs = request.output_token_ids
    num_outputs = len(outputs)
    if num_outputs < params.min_tokens:
        return False
    last = outputs[-1]
    if last in params.all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        # vLLM reports an explicit stop token id as stop_reason, plain EOS as None.
        request.stop_reason = last if last in (params.stop_token_ids or []) else None
        return True
    max_tokens = params.max_tokens
    assert max_tokens is not None
    if num_outputs >= max_tokens or num_outputs + len(request.prompt_token_ids) >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
