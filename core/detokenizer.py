"""IncrementalDetokenizer: one request's output ids -> text, a token at a time, with stop-string checks.

Decoding token by token and concatenating is wrong twice over: a byte-level BPE token may hold half of a
UTF-8 character (decoded alone it is U+FFFD), and SentencePiece-style decoders drop or add spaces depending on
the neighbours. So each step decodes a short window of ids and emits only what the new token added:

    output ids:  o0 o1 o2 o3 o4 o5
                      |     |     |
                   prefix read   end     (offsets sit between ids: ids[prefix:read] = o2 o3)

    prefix text = decode(ids[prefix:read])     already emitted; only here as left context
    new text    = decode(ids[prefix:end])      that context plus everything not yet emitted
    emit new_text[len(prefix_text):], then prefix <- read, read <- end

A window whose text ends in U+FFFD is an unfinished multi-byte character: nothing is emitted and the window
grows until the character completes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.sampling_params import RequestOutputKind, SamplingParams

_REPLACEMENT_CHAR = "\ufffd"


def _backend_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The Rust `tokenizers.Tokenizer.decode` under a transformers fast tokenizer, when calling it is what the
    tokenizer's own `decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)` does: neither
    `decode` nor `_decode` overridden by the tokenizer's class. Else None (the tokenizer's `decode` is used).

    NOTE: two decodes per output token through transformers' Python wrapper (argument conversion, kwargs,
    the clean-up branch) were most of the API process's detokenizing time at 256 streams; the Rust call alone
    returns the same string."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(tokenizer)
    if not (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerFast.decode
            and cls._decode is PreTrainedTokenizerFast._decode):
        return None
    decode = backend.decode
    return lambda ids: str(decode(ids, skip_special_tokens=skip_special_tokens))


class IncrementalDetokenizer:
    """Builds one request's output text incrementally and finds its stop strings.

    The tokenizer is anything with Hugging Face's `decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=...)`, or None, which like `params.detokenize=False` keeps ids only.

    NOTE(1): decoding starts at the first output token, with no prompt context, so the final text equals
    `tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)` (cut at a
    stop string). Clean-up is off because it rewrites text already emitted (" ." -> "."), which a stream
    cannot take back; the tokenizers we target (Llama 3, Qwen, SmolLM) have it off anyway.
    `prompt_token_ids` is kept for callers but not used as decoding context, for that reason.
    NOTE(2): if generation ends inside a multi-byte character, that unfinished character is never emitted
    (where `decode` would give U+FFFD).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        # Without a tokenizer (the engine was built to skip it) there is no text either.
        self.detokenize = params.detokenize and tokenizer is not None
        if params.stop and not self.detokenize:
            raise ValueError("stop strings need text: set detokenize=True and give the engine a tokenizer")
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Stop strings wait for min_tokens too, as stop ids do (vLLM checks them once outputs > min_tokens).
        self.min_tokens = params.min_tokens
        self.token_ids: list[int] = []
        self._text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._stopped = False
        # A stop string can only start this far back from the newest text: any earlier start would have
        # completed (and been caught) by the previous update.
        self._stop_lookback = max((len(s) for s in self.stop), default=1) - 1
        # Streaming holds back that many chars: they might be the start of a stop string that gets cut.
        # Not needed when the stop string stays in the output anyway.
        self._stream_holdback = 0 if self.include_stop_str_in_output else self._stop_lookback
        self._streamed = 0  # chars of output_text already handed out by get_next_output_text(delta=True)
        self._fast_decode = _backend_decode(tokenizer, self.skip_special_tokens) if self.detokenize else None
        # NOTE(3): a FINAL_ONLY request with no stop string is only read once it finishes, so its text is
        # decoded then, in one call, instead of two window decodes per token per step (about 5 us a request
        # a step: 0.3 ms of a 64-request decode step's host time on the CPU).
        self._deferred = (self.detokenize and not self.stop
                          and params.output_kind == RequestOutputKind.FINAL_ONLY)
        self._decoded_ids = 0  # how many of token_ids the deferred text covers

    @property
    def output_text(self) -> str:
        """The text so far (cut at the stop string once one matched); "" when not detokenizing."""
        if self._deferred and self._decoded_ids != len(self.token_ids):
            # What the windows would have emitted (NOTE(1), NOTE(2)): the whole decode, less an unfinished
            # multi-byte character at its end.
            self._text = self._decode(self.token_ids).rstrip(_REPLACEMENT_CHAR)
            self._decoded_ids = len(self.token_ids)
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        """Every output id received, including the tokens after which a stop string was found."""
        return self.token_ids

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append `new_token_ids`, extend the text, and return the stop string that matched (else None).

        After a match the text is final; the caller must finish the request and not call update again.
        """
        assert not self._stopped, "update() called after a stop string already finished this request"
        self.token_ids.extend(new_token_ids)
        if not self.detokenize or self._deferred:
            return None
        old_len = len(self._text)
        # One window step per token keeps each window short (decode cost is linear in it).
        for end in range(len(self.token_ids) - len(new_token_ids) + 1, len(self.token_ids) + 1):
            self._text += self._decode_step(end)
        if not self.stop or len(self._text) == old_len or len(self.token_ids) <= self.min_tokens:
            return None
        return self._check_stop(old_len)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to hand to the user now: everything new since the last call (`delta`) or all of it.

        While not finished, the last (longest stop string - 1) chars are held back, so a prefix of a stop
        string that will be cut off is never streamed.
        """
        holdback = 0 if finished else self._stream_holdback
        text = self.output_text
        visible = max(len(text) - holdback, 0)
        if not delta:
            return text[:visible]
        if visible <= self._streamed:
            return ""
        chunk = text[self._streamed : visible]
        self._streamed = visible
        return chunk

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids)
        return str(
            self.tokenizer.decode(
                ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
            )
        )

    def _decode_step(self, end: int) -> str:
        """Advance the window to `end` ids; return the text it adds ("" while a character is unfinished)."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset : end])
        # A U+FFFD in the middle is a real invalid sequence from the model; only at the end can it still
        # complete. Shorter-or-equal text means the token added nothing visible yet (e.g. a skipped special).
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, end
        return new_text[len(prefix_text) :]

    def _check_stop(self, old_len: int) -> str | None:
        """Find the stop string that completes first in the text added since `old_len`; cut the text there."""
        start = max(old_len - self._stop_lookback, 0)
        best: tuple[int, int, str] | None = None  # (end, begin, stop)
        for stop in self.stop:
            begin = self._text.find(stop, start)
            if begin < 0:
                continue
            candidate = (begin + len(stop), begin, stop)
            # Earliest end is the match a char-by-char check would have hit first; ties go to the longer.
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, begin, stop = best
        self._text = self._text[: end if self.include_stop_str_in_output else begin]
        self._stopped = True
        return stop
