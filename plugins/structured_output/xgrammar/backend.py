"""XgrammarBackend: compiles constraints with xgrammar's GrammarCompiler; one GrammarMatcher per request.

NOTE(1) a `grammar` is EBNF (GBNF) for xgrammar. A Lark grammar is refused by check() (xgrammar's EBNF parser
fails on it), so without a requested backend the selector sends it to llguidance, and with `backend=xgrammar` it
is a 400 naming the parse error: nothing is guessed from the text's look.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from pagedllm.api.structured_output import (
    StructuredOutputContext,
    StructuredOutputsParams,
    choice_as_ebnf,
    json_schema,
)


def unsupported(params: StructuredOutputsParams) -> list[str]:
    """Reasons xgrammar cannot serve `params` at all (not: this particular schema is invalid)."""
    reasons = []
    if params.whitespace_pattern is not None:
        reasons.append("xgrammar has no whitespace_pattern option")
    if params.json is not None:
        try:
            schema = json_schema(params)
        except ValueError:
            schema = {}  # validate() reports the bad JSON itself
        reasons += sorted(set(_unsupported_json_features(schema)))
    if params.grammar is not None:
        try:
            xgr.Grammar.from_ebnf(params.grammar)
        except Exception as exc:
            reasons.append(f"xgrammar reads EBNF grammars only, and this one does not parse as EBNF: {_short(exc)}")
    return reasons


# NOTE(2) JSON-schema features xgrammar 0.2.9 gets wrong, found by tests/test_structured_outputs.py checking every
# output with `jsonschema` (and, after them, vLLM's has_xgrammar_unsupported_json_features): a string with
# minLength / maxLength compiles to a character class that admits raw control characters and no escapes, so a
# weak model writes invalid JSON; multipleOf, uniqueItems and contains are not enforced. Such schemas go to the
# next backend (llguidance) with this reason, or fail with it when xgrammar is asked for by name.
_UNENFORCED = {
    "minLength": "string length bounds (minLength/maxLength) admit raw control characters in xgrammar 0.2.9",
    "maxLength": "string length bounds (minLength/maxLength) admit raw control characters in xgrammar 0.2.9",
    "multipleOf": "xgrammar does not enforce multipleOf",
    "uniqueItems": "xgrammar does not enforce uniqueItems",
    "contains": "xgrammar does not enforce contains",
}


def _unsupported_json_features(node: Any) -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        found += [why for key, why in _UNENFORCED.items() if key in node and not isinstance(node[key], dict)]
        for key, value in node.items():
            if key in ("enum", "const", "default", "examples"):
                continue  # values, not subschemas
            found += _unsupported_json_features(value)
    elif isinstance(node, list):
        for item in node:
            found += _unsupported_json_features(item)
    return found


def _short(exc: Exception) -> str:
    """The message of an xgrammar error without its C++ source prefix ("[11:17:45] /project/cpp/x.cc:94: ")."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:300]


def _grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The tokenizer-free grammar of `params` (what validate() checks and compile() builds on)."""
    kind = params.kind
    field = f"structured_outputs.{kind}"
    try:
        if kind in ("json", "json_object"):
            return xgr.Grammar.from_json_schema(json_schema(params), any_whitespace=not params.disable_any_whitespace)
        if kind == "regex":
            assert params.regex is not None
            if "\x00" in params.regex:
                raise ValueError("a NUL character is not allowed")
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            return xgr.Grammar.from_ebnf(choice_as_ebnf(params.choice))
        if kind == "grammar":
            assert params.grammar is not None
            return xgr.Grammar.from_ebnf(params.grammar)
        assert params.structural_tag is not None
        return xgr.Grammar.from_structural_tag(*_structural_tag_args(params.structural_tag))
    except ValueError as exc:
        if str(exc).startswith("structured_outputs."):
            raise
        raise ValueError(f"{field}: {_short(exc)}") from None
    except Exception as exc:  # xgrammar raises RuntimeError / its own errors for what it cannot parse
        raise ValueError(f"{field}: {_short(exc)}") from None


def _structural_tag_args(text: str) -> tuple[Any, ...]:
    """vLLM's two structural-tag forms: the legacy {"structures": [...], "triggers": [...]} or the new format."""
    tag = json.loads(text)
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return (items, tag["triggers"])
    return (text,)


_BATCH: xgr.BatchGrammarMatcher | None = None  # made on the first batch fill
_POOL: ThreadPoolExecutor | None = None  # accept_many's, made on the first large batch
_ACCEPT_THREADS = min(4, (os.cpu_count() or 1) // 2)
# One C++ call for a batch of single tokens, where this xgrammar has it (0.2.9 does).
_BATCH_ACCEPT = getattr(xgr.BatchGrammarMatcher, "batch_accept_token", None)
# NOTE(3) reading the batch accept's verdicts. xgrammar 0.2.9 returns them as a tvm_ffi Array, and its
# wrapper reads it back element by element: two FFI calls per element (the length, the item), each letting go
# of the GIL and taking it back. On the grammar worker's threads, beside the engine thread's Python, every
# taking back waits for the GIL: measured on the 2-core CPU machine (256 matchers of
# examples/gpu/bench_structured.py's schema, a busy Python thread beside, switch interval 0.25 ms), the wrapper
# took 6.95 ms a batch and the raw call 2.58 ms (2.2-2.4 ms alone, either way). So where xgrammar's binding
# module is what 0.2.9 ships, the call goes to it directly and the verdicts are read with one membership test
# (one FFI call that keeps the GIL): every token the mask allowed is accepted, so a rejection is a backend bug and
# only then is the array read element by element.
_RAW_ACCEPT = getattr(getattr(getattr(xgr, "base", None), "_core", None), "BatchGrammarMatcher", None)
_RAW_ACCEPT = getattr(_RAW_ACCEPT, "batch_accept_token", None)


def _no_release_contains() -> Any:
    """tvm_ffi's Array membership test as a function object of our own that keeps the GIL: a lookup of a
    few hundred bytes is shorter than taking the GIL back (NOTE 3). The module's own object is untouched."""
    try:
        import tvm_ffi

        contains = tvm_ffi.get_global_func("ffi.ArrayContains")
        contains.release_gil = False
        return contains
    except Exception:  # another runtime: the `in` operator, which releases it
        return None


_CONTAINS = _no_release_contains() if _RAW_ACCEPT is not None else None


def _batch_accept(matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[bool]:
    """xgrammar's batch accept, its verdicts read as NOTE 3 says."""
    if _RAW_ACCEPT is None or not hasattr(matchers[0], "_handle"):
        assert _BATCH_ACCEPT is not None
        return [bool(ok) for ok in _BATCH_ACCEPT(matchers, tokens)]
    verdicts = _RAW_ACCEPT([m._handle for m in matchers], tokens, False)
    if not (_CONTAINS(verdicts, 0) if _CONTAINS is not None else 0 in verdicts):
        return [True] * len(matchers)
    return [bool(ok) for ok in verdicts]


def _accept_each(grammars: list[XgrammarGrammar], tokens: list[list[int]]) -> list[bool]:
    return [g.accept_tokens("", t) for g, t in zip(grammars, tokens)]


def _accept_part(grammars: list[XgrammarGrammar], tokens: list[list[int]]) -> list[bool]:
    """accept_tokens over a part of a batch: the live grammars' single tokens in one `batch_accept_token`
    call, the rest (a terminated grammar, several tokens) one by one as accept_tokens does."""
    single = [i for i, (g, t) in enumerate(zip(grammars, tokens)) if len(t) == 1 and not g._terminated]
    if len(single) < 2:
        return _accept_each(grammars, tokens)
    results = [True] * len(grammars)
    oks = _batch_accept([grammars[i].matcher for i in single], [tokens[i][0] for i in single])
    # A matcher ends only by accepting one of its stop tokens (terminate_without_stop_token is off), so the
    # token says it: no is_terminated() per matcher. Each of those calls lets go of the GIL and takes it
    # back, and on the grammar worker's threads, beside the engine thread's Python, every taking back waited
    # out a switch interval: 256 of them made the batch accept ~8 ms a step on the H200 host, not ~1.
    for i, ok in zip(single, oks):
        results[i] = ok
        if ok:
            grammars[i]._terminated = tokens[i][0] in grammars[i].stop_ids
    if len(single) < len(grammars):
        chosen = set(single)
        for i, (g, t) in enumerate(zip(grammars, tokens)):
            if i not in chosen:
                results[i] = g.accept_tokens("", t)
    return results


class XgrammarGrammar:
    """One request's matcher (pagedllm.api.structured_output.StructuredOutputGrammar)."""

    def __init__(self, matcher: xgr.GrammarMatcher, stop_ids: frozenset[int] = frozenset()) -> None:
        self.matcher = matcher
        self.stop_ids = stop_ids  # the matcher's stop tokens: accepting one ends it (_accept_part)
        self._terminated = False

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if self._terminated:
                return True  # tokens after the end (a stop inside accepted drafts) are the scheduler's to drop
            if not self.matcher.accept_token(token):
                return False
            self._terminated = self.matcher.is_terminated()
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted: list[int] = []
        if self._terminated:
            return accepted
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted.append(token)
            if self.matcher.is_terminated():
                break
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self._terminated = self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    # Both batch forms below spend their time in xgrammar calls that release the GIL (one call per part of
    # the batch where xgrammar has `batch_accept_token`), so the engine's manager may run them on a thread
    # beside its own host work (core structured_output/manager.py NOTE 4). The accept's verdicts are read
    # in one call too (NOTE 3): read one by one, they made it ~3x slower beside the engine thread's Python.
    gil_free_batches = _BATCH_ACCEPT is not None

    @staticmethod
    def accept_many(grammars: list[XgrammarGrammar], tokens: list[list[int]]) -> list[bool]:
        """accept_tokens for many requests at once. xgrammar's matcher releases the GIL, and accepting a token
        is its costly call (~30 us on the H200 host for a JSON schema's state, 8 ms a step at 256 requests,
        against ~3 ms on 4 threads), so large batches go to a pool of up to 4 threads (half the cores), each
        part one `batch_accept_token` call where xgrammar has it (the thread takes the GIL once a part, not
        once a token: no queueing behind another thread's Python)."""
        n, threads = len(grammars), _ACCEPT_THREADS
        part = _accept_part if _BATCH_ACCEPT is not None else _accept_each
        if threads <= 1 or n < 64:
            return part(grammars, tokens)
        global _POOL
        if _POOL is None:
            _POOL = ThreadPoolExecutor(threads, thread_name_prefix="pagedllm-grammar-accept")
        size = (n + threads - 1) // threads
        parts = _POOL.map(lambda lo: part(grammars[lo:lo + size], tokens[lo:lo + size]), range(0, n, size))
        return [ok for oks in parts for ok in oks]

    @staticmethod
    def fill_bitmasks(grammars: list[XgrammarGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Many rows at once, on xgrammar's own threads (half the machine's cores), as vLLM fills a large
        batch in parallel (measured on the H200 at 256 requests: 0.72 -> 0.85 of free-text tok/s)."""
        global _BATCH
        if _BATCH is None:
            _BATCH = xgr.BatchGrammarMatcher()
        _BATCH.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)

    def is_terminated(self) -> bool:
        return self._terminated


class XgrammarBackend:
    """pagedllm.api.structured_output.StructuredOutputBackend over xgrammar."""

    def __init__(self, ctx: StructuredOutputContext) -> None:
        info = xgr.TokenizerInfo.from_huggingface(ctx.tokenizer, vocab_size=ctx.vocab_size,
                                                  stop_token_ids=list(ctx.eos_token_ids) or None)
        # The compiler's own cache is off: the engine's manager caches compilations by constraint key.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.stop_ids = frozenset(info.stop_token_ids)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        reasons = unsupported(params)
        if reasons:
            raise ValueError(f"structured_outputs.{params.kind}: " + "; ".join(reasons))
        _grammar(params)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        grammar = _grammar(params)
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as exc:
            raise ValueError(f"structured_outputs.{params.kind}: {_short(exc)}") from None

    def make_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled), self.stop_ids)
