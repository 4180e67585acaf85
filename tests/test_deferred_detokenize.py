"""A FINAL_ONLY request without stop strings is detokenized once, when read (detokenizer.py NOTE(3)):
its text must be exactly what the per-step windows give, against real tokenizers, and no decode may run
while tokens arrive. Stop strings keep the per-step path (they must be found as the text grows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_detokenizer import TEXTS, smollm2, tiny_bpe  # noqa: F401 (fixtures)

from pagedllm.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

FINAL = RequestOutputKind.FINAL_ONLY


@pytest.fixture(params=["smollm2", "tiny_bpe"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def _feed(tokenizer: Any, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, [], params)
    for token in ids:
        assert detok.update([token]) is None
    return detok


@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "emoji", "cjk", "mixed"])
@pytest.mark.parametrize("skip", [True, False])
def test_deferred_text_equals_the_windows(tokenizer: Any, text: str, skip: bool) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        ids = ids + [int(tokenizer.eos_token_id)]  # a special token at the end: skipped or kept
    incremental = _feed(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    deferred = _feed(tokenizer, ids, SamplingParams(skip_special_tokens=skip, output_kind=FINAL))
    assert deferred.output_text == incremental.output_text
    assert deferred.output_text.startswith(text)
    assert deferred.get_next_output_text(finished=True, delta=False) == incremental.output_text


def test_unfinished_character_at_the_end_is_not_emitted(tiny_bpe: Any) -> None:  # noqa: F811
    ids = tiny_bpe.encode("ok 世", add_special_tokens=False)[:-1]  # the last byte of 世 missing
    assert tiny_bpe.decode(ids).endswith("\ufffd")
    assert _feed(tiny_bpe, ids, SamplingParams(output_kind=FINAL)).output_text == "ok "


class _CountingTokenizer:
    """Counts decode calls (not a transformers class, so the detokenizer calls `decode` itself)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.calls += 1
        return str(self.inner.decode(ids, **kwargs))


def test_no_decode_until_read_and_one_after(tiny_bpe: Any) -> None:  # noqa: F811
    counting = _CountingTokenizer(tiny_bpe)
    ids = tiny_bpe.encode(TEXTS[0], add_special_tokens=False)
    deferred = _feed(counting, ids, SamplingParams(output_kind=FINAL))
    assert counting.calls == 0
    assert deferred.output_text == TEXTS[0] and deferred.output_text == TEXTS[0]
    assert counting.calls == 1  # read twice, decoded once
    _feed(counting, ids, SamplingParams())  # the per-step path: two window decodes a token
    assert counting.calls == 1 + 2 * len(ids)


def test_stop_strings_keep_the_per_step_path(tiny_bpe: Any) -> None:  # noqa: F811
    ids = tiny_bpe.encode("the quick brown fox jumps", add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny_bpe, [], SamplingParams(stop=["brown"], output_kind=FINAL))
    stop = None
    for token in ids:
        stop = detok.update([token])
        if stop is not None:
            break
    assert stop == "brown" and detok.output_text == "the quick "


def test_llm_generate_text_is_the_decode_of_its_tokens(tmp_path: Path, tiny_bpe: Any) -> None:  # noqa: F811
    """LLM.generate asks for FINAL_ONLY outputs: the text it returns is the tokenizer's decode of the ids."""
    from pagedllm import LLM
    from pagedllm.testing.tiny import save_tiny_model

    folder = save_tiny_model("llama", tmp_path)
    tiny_bpe.save_pretrained(folder)
    llm = LLM(folder, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, skip_special_tokens=False)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 3]}], params)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 12
        assert out.outputs[0].text == tiny_bpe.decode(ids, skip_special_tokens=False).rstrip("\ufffd")
