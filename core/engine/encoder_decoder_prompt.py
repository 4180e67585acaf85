"""An encoder-decoder model's prompt: which ids go to the encoder and which start the decoder.

Spellings (vLLM's, for BART-style models):

    "text" | [ids] | {"prompt": ...} | {"prompt_token_ids": ...}     the encoder prompt; the decoder starts
                                                                    with [decoder_start_token_id]
    {"encoder_prompt": P, "decoder_prompt": Q}                      each of P, Q one of the above (Q optional)

The decoder's ids always begin with the model's decoder start token: it is prepended when the decoder
prompt is empty or starts otherwise (transformers' `_prepare_decoder_input_ids_for_generation`, which
vLLM followed), so a greedy run equals transformers' `generate` given the same decoder prompt.

A decoder-only model refuses the encoder-decoder spelling, naming the field, rather than silently running
one half of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (prompt) -> (text or None, token ids): the frontend's tokenizer step (input_processing.tokenize_prompt).
Tokenize = Callable[[Any], tuple[str | None, list[int]]]

# Carries already-resolved encoder ids inside a normalized decoder prompt dict (LLM.generate checks a batch's
# prompts before queueing them, then hands each on in this form).
ENCODER_IDS_KEY = "encoder_prompt_token_ids"
_SPLIT_KEYS = ("encoder_prompt", "decoder_prompt")


@dataclass(frozen=True)
class EncoderDecoderLimits:
    """What an encoder-decoder model fixes about its prompts (None on ModelLimits for decoder-only models)."""

    decoder_start_token_id: int
    max_encoder_len: int  # the encoder's position limit

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> EncoderDecoderLimits | None:
        """The limits of an HF config with `is_encoder_decoder` set (BART, Whisper, T5); None otherwise."""
        if not getattr(hf_config, "is_encoder_decoder", False):
            return None
        start = getattr(hf_config, "decoder_start_token_id", None)
        if start is None:
            start = getattr(hf_config, "bos_token_id", None)
        if start is None:
            raise ValueError("an encoder-decoder model needs decoder_start_token_id (or bos_token_id) in its config")
        max_len = getattr(hf_config, "max_source_positions", None) or hf_config.max_position_embeddings
        return cls(int(start), int(max_len))


def split_prompt(
    prompt: Any, limits: EncoderDecoderLimits | None, tokenize: Tokenize, vocab_size: int
) -> tuple[Any, list[int] | None]:
    """(the decoder prompt, the encoder prompt's ids); (prompt, None) for a decoder-only model.

    The decoder prompt comes back as a {"prompt", "prompt_token_ids"} dict for an encoder-decoder model.
    Raises ValueError subclasses through `tokenize`, and RequestValidationError for a bad encoder prompt.
    """
    from pagedllm.engine.input_processing import RequestValidationError

    is_dict = isinstance(prompt, dict)
    if limits is None:
        used = [k for k in (*_SPLIT_KEYS, ENCODER_IDS_KEY) if is_dict and k in prompt]
        if used:
            raise RequestValidationError(
                f"'{used[0]}' is only for encoder-decoder models; this model is decoder-only: pass the prompt "
                "as text, token ids or {'prompt' | 'prompt_token_ids': ...}", used[0],
            )
        return prompt, None
    if is_dict and ENCODER_IDS_KEY in prompt:  # already split (LLM.generate's checked form)
        rest = {k: v for k, v in prompt.items() if k != ENCODER_IDS_KEY}
        return rest, list(prompt[ENCODER_IDS_KEY])
    if is_dict and any(k in prompt for k in _SPLIT_KEYS):
        unknown = sorted(set(prompt) - set(_SPLIT_KEYS))
        if unknown:
            raise RequestValidationError(
                f"an encoder/decoder prompt dict takes only 'encoder_prompt' and 'decoder_prompt', got "
                f"{unknown[0]!r}", unknown[0],
            )
        if "encoder_prompt" not in prompt:
            raise RequestValidationError("an encoder/decoder prompt dict needs 'encoder_prompt'", "encoder_prompt")
        encoder, decoder, field = prompt["encoder_prompt"], prompt.get("decoder_prompt"), "encoder_prompt"
    else:
        encoder, decoder, field = prompt, None, "prompt"
    _, encoder_ids = tokenize(encoder)
    _check_encoder_ids(encoder_ids, limits, vocab_size, field)
    text, decoder_ids = (None, []) if decoder is None else tokenize(decoder)
    start = limits.decoder_start_token_id
    if not decoder_ids or decoder_ids[0] != start:
        decoder_ids = [start, *decoder_ids]
    return {"prompt": text, "prompt_token_ids": decoder_ids}, encoder_ids


def _check_encoder_ids(ids: list[int], limits: EncoderDecoderLimits, vocab_size: int, field: str) -> None:
    from pagedllm.engine.input_processing import RequestValidationError

    if not ids:
        raise RequestValidationError("the encoder prompt is empty", field)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestValidationError(f"encoder prompt token ids must be in [0, {vocab_size}), got {bad[:5]}", field)
    if len(ids) > limits.max_encoder_len:
        raise RequestValidationError(
            f"the encoder prompt has {len(ids)} tokens; this model's encoder takes at most "
            f"{limits.max_encoder_len}", field,
        )
