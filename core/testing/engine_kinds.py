"""Conformance checks for the kinds that act on a running engine: proposers, executors, logits processors,
commands and entrypoints.

- check_proposer: speculative decoding with the proposer must leave greedy tokens exactly as without it (the
  verifier accepts a draft only where it equals the target's argmax), and the proposer must actually propose
  on prompts that repeat themselves (a proposer that never drafts passes the first test vacuously).
- check_executor: greedy tokens through the executor equal the in-process reference (uniproc, one rank),
  at the tensor-parallel size asked for.
- check_logits_processor: the processor built as the engine builds it keeps the logits' shape, dtype and
  device, is deterministic, leaves no NaN and no row without a token to sample, and runs inside an engine
  whose every sampled token is in the vocabulary; the report carries the engine's tokens, so a test can
  assert the processor's own semantics on them.
- check_command / check_entrypoint: what `load()` returns is the protocol's shape; a command adds exactly its
  registered subcommand, whose `--help` parses and whose parser sets `func`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.plugin_spec import PluginKind
from pagedllm.testing.components import find_spec, manager_or_default, resolve
from pagedllm.testing.engine_run import EngineRun, merged, run_greedy

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager

# Prompts whose suffixes recur inside them, so a prompt-lookup proposer has something to find, mixed with
# one that does not repeat (its drafts, if any, must be rejected cleanly).
REPEATING_PROMPTS: tuple[tuple[int, ...], ...] = (
    (5, 6, 7, 8, 9) * 4,
    (11, 12, 13) * 5 + (14,),
    tuple(range(20, 37)),
)


@dataclass
class ProposerReport:
    name: str
    prompts: int
    draft_tokens: int
    accepted_tokens: int
    steps_without: int
    steps_with: int


@dataclass
class ExecutorReport:
    name: str
    tensor_parallel_size: int
    tokens_compared: int


@dataclass
class LogitsProcessorReport:
    name: str
    rows: int
    changed_entries: int  # logits the processor changed on the random batch
    engine_tokens: int
    engine_output_differs: bool  # greedy tokens with the processor differ from those without it
    tokens: list[list[int]] = field(default_factory=list)  # the engine's greedy tokens with the processor
    notes: list[str] = field(default_factory=list)


def _first_difference(a: list[list[int]], b: list[list[int]]) -> str | None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            pos = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return f"prompt {i}, position {pos}: {x[pos:pos + 4]} instead of {y[pos:pos + 4]}"
    return None


def check_proposer(
    name: str,
    model_dir: str,
    *,
    speculative: Mapping[str, Any] | None = None,
    prompts: Sequence[Sequence[int]] = REPEATING_PROMPTS,
    max_tokens: int = 12,
    config: Mapping[str, Any] | None = None,
    plugin_manager: PluginManager | None = None,
) -> ProposerReport:
    """:param speculative: more of the `speculative` section (e.g. `draft_model` for a draft proposer)."""
    pm = manager_or_default(plugin_manager)
    find_spec(PluginKind.PROPOSER, name, pm)
    without = run_greedy(model_dir, prompts, max_tokens, config=config, plugin_manager=pm)
    section = {"method": name, "num_speculative_tokens": 3, **(speculative or {})}
    spec_config = merged(config or {}, {"speculative": section})
    with_spec = run_greedy(model_dir, prompts, max_tokens, config=spec_config, plugin_manager=pm)
    diff = _first_difference(with_spec.tokens, without.tokens)
    if diff:
        raise AssertionError(f"proposer {name!r}: speculative decoding changed the greedy tokens at {diff}")
    stats = with_spec.last_stats
    drafts = int(getattr(stats, "spec_num_draft_tokens", 0))
    if drafts == 0:
        raise AssertionError(
            f"proposer {name!r} proposed no token for {len(prompts)} prompts that repeat themselves; a proposer "
            "that never drafts cannot be checked (pass prompts it should draft for)"
        )
    return ProposerReport(name, len(prompts), drafts, int(getattr(stats, "spec_num_accepted_tokens", 0)),
                          len(without.steps), len(with_spec.steps))


def check_executor(
    name: str,
    model_dir: str,
    *,
    tensor_parallel_size: int = 1,
    prompts: Sequence[Sequence[int]] = REPEATING_PROMPTS,
    max_tokens: int = 8,
    config: Mapping[str, Any] | None = None,
    plugin_manager: PluginManager | None = None,
) -> ExecutorReport:
    pm = manager_or_default(plugin_manager)
    find_spec(PluginKind.EXECUTOR, name, pm)
    reference = run_greedy(model_dir, prompts, max_tokens, config=merged(config or {}, {"parallel": {
        "executor": "uniproc", "tensor_parallel_size": 1}}), plugin_manager=pm)
    got: EngineRun = run_greedy(model_dir, prompts, max_tokens, config=merged(config or {}, {"parallel": {
        "executor": name, "tensor_parallel_size": tensor_parallel_size}}), plugin_manager=pm)
    diff = _first_difference(got.tokens, reference.tokens)
    if diff:
        raise AssertionError(f"executor {name!r} (tp {tensor_parallel_size}): greedy tokens differ from the "
                             f"in-process reference at {diff}")
    return ExecutorReport(name, tensor_parallel_size, sum(len(t) for t in got.tokens))


def check_logits_processor(
    name: str,
    model_dir: str,
    *,
    section: Mapping[str, Any] | None = None,
    extra_args: Mapping[str, Any] | None = None,
    vocab_size: int = 97,
    rows: int = 5,
    config: Mapping[str, Any] | None = None,
    plugin_manager: PluginManager | None = None,
) -> LogitsProcessorReport:
    """:param section: the processor's `plugins.<name>` config section; :param extra_args: per-request
    arguments (SamplingParams.extra_args) given to every row and every engine request."""
    import torch

    from pagedllm.sample.logits_processor import LogitsBatch, LogitsProcessorContext
    from pagedllm.sampling_params import SamplingParams

    pm = manager_or_default(plugin_manager)
    factory = resolve(PluginKind.LOGITS_PROCESSOR, name, pm)
    sections = {name: dict(section or {})}
    model = pm.config_models().get(name)
    cfg: Any = model.model_validate(sections[name]) if model is not None else sections[name]
    ctx = LogitsProcessorContext(name, cfg, vocab_size, torch.device("cpu"))
    proc = factory(ctx)
    params = [SamplingParams(extra_args=dict(extra_args) if extra_args else None) for _ in range(rows)]
    gen = torch.Generator().manual_seed(0)
    batch = LogitsBatch(params, [[int(t) for t in torch.randint(0, vocab_size, (3,), generator=gen)]
                                 for _ in range(rows)],
                        [[1, 2, 3] for _ in range(rows)])
    logits = torch.randn(rows, vocab_size, generator=gen)
    first = proc.apply(logits.clone(), batch)
    if first.shape != logits.shape or first.dtype != logits.dtype or first.device != logits.device:
        raise AssertionError(f"logits processor {name!r} returned {tuple(first.shape)} {first.dtype} on "
                             f"{first.device} for {tuple(logits.shape)} {logits.dtype} on {logits.device}")
    if torch.isnan(first).any():
        raise AssertionError(f"logits processor {name!r} produced NaN logits")
    if (first == float("-inf")).all(dim=-1).any():
        raise AssertionError(f"logits processor {name!r} left a row with every token at -inf (nothing to sample)")
    second = proc.apply(logits.clone(), batch)
    if not torch.equal(first, second):
        raise AssertionError(f"logits processor {name!r} is not deterministic: the same batch gave other logits")
    changed = int((first != logits).sum())

    engine_config = merged(config or {}, {"logits_processors": [name], "plugins": sections})
    run = run_greedy(model_dir, REPEATING_PROMPTS, 6, config=engine_config, plugin_manager=pm,
                     extra_args=extra_args)
    base = run_greedy(model_dir, REPEATING_PROMPTS, 6, config=config, plugin_manager=pm, extra_args=extra_args)
    vocab = _vocab_size(model_dir)
    bad = [t for toks in run.tokens for t in toks if not 0 <= t < vocab]
    if bad:
        raise AssertionError(f"logits processor {name!r}: the engine sampled token ids outside the vocabulary: {bad[:5]}")
    report = LogitsProcessorReport(name, rows, changed, sum(len(t) for t in run.tokens), run.tokens != base.tokens,
                                   run.tokens)
    if changed == 0:
        report.notes.append("changed no logit of the random batch (an identity for these arguments)")
    return report


def _vocab_size(model_dir: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir).vocab_size)


def check_command(name: str, plugin_manager: PluginManager | None = None) -> str:
    """Returns the subcommand's help text."""
    pm = manager_or_default(plugin_manager)
    command = resolve(PluginKind.COMMAND, name, pm)
    parser = argparse.ArgumentParser(prog="pagedllm")
    subparsers = parser.add_subparsers(dest="command")
    command.add_parser(subparsers)
    added = sorted(subparsers.choices)
    if added != [name]:
        raise AssertionError(f"command {name!r}: add_parser added {added or 'no subcommand'}, not exactly {[name]}")
    sub = subparsers.choices[name]
    if sub.get_default("func") is None and not _subcommands_set_func(sub):
        raise AssertionError(f"command {name!r}: its parser sets no `func` (set_defaults(func=...))")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parser.parse_args([name, "--help"])
    if name not in out.getvalue():
        raise AssertionError(f"command {name!r}: `pagedllm {name} --help` printed no usage naming it")
    return out.getvalue()


def _subcommands_set_func(parser: argparse.ArgumentParser) -> bool:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    subs = [p for a in actions for p in a.choices.values()]
    return bool(subs) and all(p.get_default("func") is not None for p in subs)


def check_entrypoint(name: str, plugin_manager: PluginManager | None = None) -> Any:
    """The entrypoint's callable (resolved as `pagedllm serve --entrypoint NAME` resolves it)."""
    import inspect

    pm = manager_or_default(plugin_manager)
    entry = resolve(PluginKind.ENTRYPOINT, name, pm)
    if not callable(entry):
        raise AssertionError(f"entrypoint {name!r}: load() returned {type(entry).__name__}, not a callable")
    try:
        inspect.signature(entry).bind(object(), object())
    except TypeError as exc:
        raise AssertionError(f"entrypoint {name!r}: cannot be called as entry(config, options): {exc}") from None
    return entry
