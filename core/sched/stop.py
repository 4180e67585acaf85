"""Token-level stop rules applied in the engine core (stop *strings* are the detokenizer's job)."""

from __future__ import annotations

from pagedllm.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status if its last token ends it; return whether it did."""
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if last in params.all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        # vLLM reports an explicit stop token id as stop_reason, plain EOS as None.
        request.stop_reason = last if last in (params.stop_token_ids or []) else None
        return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
