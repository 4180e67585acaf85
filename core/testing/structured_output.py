"""check_structured_output_backend: a backend's grammars against references nobody here wrote.

For each case the backend compiles the constraint for a tokenizer, and seeded random walks pick allowed tokens
until the grammar terminates. Along every walk:

- the mask is never empty, every token it allows is accepted, and one it forbids is refused by validate_tokens;
- rollback restores the mask (what speculative decoding relies on);
- for regex and choice cases the mask is checked token by token against a reference: a token is allowed
  exactly when the text so far plus the token's text can still become a match (the `regex` module's partial
  matching; `str.startswith` for choices), and EOS exactly when the text is a full match. With
  `complete_masks=False` only "allowed implies alive" is required: llguidance, where only one string can
  follow, allows just that string's canonical tokens (after "y" in `(yes|no)`, "es" but not "e");
- the finished text matches: `jsonschema` validates JSON cases, `re.fullmatch` regex cases, membership choices.

Invalid constraints must be refused by `validate` with a ValueError naming the field ("structured_outputs....").

The default tokenizer is `small_tokenizer()`: a byte-level BPE of a few hundred tokens trained here, so the
token-by-token checks cover the whole vocabulary cheaply; pass a model's own tokenizer to check that instead.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.plugin_spec import PluginKind
from pagedllm.protocols.structured_output import StructuredOutputContext
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.bitmask import allocate_bitmask
from pagedllm.testing.components import resolve

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager

_CORPUS = (
    'The quick brown fox jumps over the lazy dog. {"name": "Ada", "age": 36, "tags": ["x", "y"]} '
    "id-123 abc-4567 yes no maybe true false null 0123456789 [1, 2, 3] {\"a\": {\"b\": []}} "
    "Pack my box with five dozen liquor jugs; sphinx of black quartz, judge my vow! "
) * 4

DEFAULT_CASES: tuple[StructuredOutputsParams, ...] = (
    StructuredOutputsParams(regex=r"[a-z]{2,4}-[0-9]{2,3}"),
    StructuredOutputsParams(regex=r"(yes|no)( please)?"),
    StructuredOutputsParams(choice=["yes", "no", "maybe so", "y"]),
    StructuredOutputsParams(json={
        "type": "object",
        "properties": {"name": {"enum": ["Ada", "Bo"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                       "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
        "required": ["name", "age", "tags"], "additionalProperties": False,
    }, disable_any_whitespace=True),
)
DEFAULT_INVALID: tuple[StructuredOutputsParams, ...] = (
    StructuredOutputsParams(regex="a[b"),
    StructuredOutputsParams(json={"type": "objectx"}),
)


@dataclass
class StructuredOutputReport:
    cases: int = 0
    walks: int = 0
    steps: int = 0
    masks_checked_exactly: int = 0  # steps whose mask was compared token by token with the reference
    texts: list[str] = field(default_factory=list)


def small_tokenizer() -> Any:
    """A byte-level BPE tokenizer (GPT-2 style, ~300 tokens, `<|end|>` its EOS) trained on a fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def check_structured_output_backend(
    name: str,
    cases: Sequence[StructuredOutputsParams] = DEFAULT_CASES,
    *,
    invalid: Sequence[StructuredOutputsParams] = DEFAULT_INVALID,
    tokenizer: Any = None,
    walks: int = 4,
    max_steps: int = 64,
    complete_masks: bool = True,
    seed: int = 0,
    plugin_manager: PluginManager | None = None,
) -> StructuredOutputReport:
    """Drive backend `name` (registered, kind `structured_output`) over `cases`; AssertionError says what broke.

    `invalid` constraints must each make `validate` raise ValueError naming the field.
    """
    backend_cls = resolve(PluginKind.STRUCTURED_OUTPUT, name, plugin_manager)
    tokenizer = tokenizer if tokenizer is not None else small_tokenizer()
    vocab_size = len(tokenizer)
    eos = int(tokenizer.eos_token_id)
    backend = backend_cls(StructuredOutputContext(tokenizer, vocab_size, (eos,)))
    texts = _token_texts(tokenizer, vocab_size, eos)
    report = StructuredOutputReport()
    rng = random.Random(seed)
    for case in invalid:
        try:
            backend_cls.validate(case)
        except ValueError as exc:
            assert str(exc).startswith("structured_outputs"), (
                f"{name}: validate({case}) raised, but its message does not name the field "
                f"(structured_outputs...): {exc}")
        else:
            raise AssertionError(f"{name}: validate accepted an invalid constraint: {case}")
    for case in cases:
        backend_cls.validate(case)
        compiled = backend.compile(case)
        report.cases += 1
        for _ in range(walks):
            text = _walk(name, backend, compiled, case, tokenizer, texts, eos, rng, max_steps, report,
                         complete_masks)
            _assert_matches(name, case, text)
            report.walks += 1
            report.texts.append(text)
    return report


def _token_texts(tokenizer: Any, vocab_size: int, eos: int) -> list[str | None]:
    """Each token's text, or None where the reference cannot say what it is (EOS, other special tokens,
    tokens that are part of a multi-byte character, or decode to nothing): those are checked separately."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    out: list[str | None] = []
    for t in range(vocab_size):
        text = tokenizer.decode([t]) if t not in special and t != eos else ""
        out.append(text if text and "\ufffd" not in text else None)
    return out


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    words = bitmask[0].tolist()
    return [t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1]


def _walk(name: str, backend: Any, compiled: Any, case: StructuredOutputsParams, tokenizer: Any,
          texts: list[str | None], eos: int, rng: random.Random, max_steps: int, report: StructuredOutputReport,
          complete_masks: bool) -> str:
    grammar = backend.make_grammar(compiled)
    reference = _reference(case)
    vocab_size = len(texts)
    ids: list[int] = []
    text = ""
    bitmask = allocate_bitmask(1, vocab_size)
    for step in range(max_steps):
        bitmask.fill_(-1)
        grammar.fill_bitmask(bitmask, 0)
        allowed = _allowed(bitmask, vocab_size)
        assert allowed, f"{name}: empty mask after {text!r} ({case.kind}): the request could never finish"
        if reference is not None:
            alive, complete = reference
            for t, tok_text in enumerate(texts):
                if tok_text is None:
                    continue
                expected = alive(text + tok_text)
                if expected and not complete_masks:
                    continue
                assert ((t in allowed) if expected else (t not in allowed)), (
                    f"{name}: after {text!r}, token {t} ({tok_text!r}) is {'forbidden' if expected else 'allowed'}"
                    f" by the mask but the reference says it {'can' if expected else 'cannot'} continue a "
                    f"{case.kind} match")
            assert (eos in allowed) == complete(text) or (complete_masks is False and eos not in allowed), (
                f"{name}: after {text!r}, EOS is {'allowed' if eos in allowed else 'forbidden'} but the text "
                f"{'is' if complete(text) else 'is not'} a full {case.kind} match")
            report.masks_checked_exactly += 1
        forbidden = next((t for t in rng.sample(range(vocab_size), min(64, vocab_size)) if t not in allowed), None)
        choice = rng.choice(allowed)
        assert grammar.validate_tokens([choice]) == [choice], (
            f"{name}: validate_tokens refused allowed token {choice} after {text!r}")
        if forbidden is not None:
            assert grammar.validate_tokens([forbidden]) == [], (
                f"{name}: validate_tokens accepted token {forbidden}, which the mask forbids, after {text!r}")
        if step % 3 == 1 and choice != eos:  # rollback restores the state (speculative drafts)
            before = bitmask.clone()
            assert grammar.accept_tokens("check", [choice])
            grammar.rollback(1)
            bitmask.fill_(-1)
            grammar.fill_bitmask(bitmask, 0)
            assert torch.equal(bitmask, before), f"{name}: rollback(1) after {text!r} did not restore the mask"
        assert grammar.accept_tokens("check", [choice]), (
            f"{name}: accept_tokens refused token {choice}, which the mask allowed, after {text!r}")
        report.steps += 1
        if choice == eos:
            assert grammar.is_terminated(), f"{name}: EOS accepted after {text!r} but the grammar did not terminate"
            return text
        assert not grammar.is_terminated(), f"{name}: terminated after {text!r} without EOS"
        ids.append(choice)
        text = tokenizer.decode(ids)
    raise AssertionError(f"{name}: {case.kind} walk did not finish in {max_steps} tokens: {text!r}")


def _reference(case: StructuredOutputsParams) -> tuple[Any, Any] | None:
    """(alive(text), complete(text)) from references independent of any backend, where there is one."""
    if case.regex is not None:
        import regex as reference_regex  # the `regex` package: partial matching

        pattern = reference_regex.compile(case.regex)
        return (lambda s: pattern.fullmatch(s, partial=True) is not None,
                lambda s: pattern.fullmatch(s) is not None)
    if case.choice is not None:
        choices = list(case.choice)
        return (lambda s: any(c.startswith(s) for c in choices), lambda s: s in choices)
    return None


def _assert_matches(name: str, case: StructuredOutputsParams, text: str) -> None:
    if case.regex is not None:
        assert re.fullmatch(case.regex, text), f"{name}: {text!r} does not match {case.regex!r}"
    elif case.choice is not None:
        assert text in case.choice, f"{name}: {text!r} is not one of {case.choice}"
    elif case.json is not None or case.json_object:
        value = json.loads(text)
        if case.json is not None:
            import jsonschema

            schema = json.loads(case.json) if isinstance(case.json, str) else case.json
            jsonschema.validate(value, schema)
        else:
            assert isinstance(value, dict), f"{name}: json_object produced {text!r}"
