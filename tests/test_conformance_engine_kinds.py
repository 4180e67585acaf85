"""The conformance kit's engine-level checks (pagedllm.testing.engine_kinds) against the in-tree proposers,
executors, command and entrypoint, and the example package's logits processor; each check also shown to fail
on a component that breaks its contract."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_example_plugins import installed  # noqa: F401  (the module-scoped fixture that pip-installs it)

from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import PluginKind
from pagedllm.testing import (
    check_command,
    check_entrypoint,
    check_executor,
    check_logits_processor,
    check_proposer,
)

Register = Callable[..., Any]


def test_ngram_proposer(pagedllm_tiny_model: Callable[[str], str]) -> None:
    report = check_proposer("ngram", pagedllm_tiny_model("llama"))
    assert report.draft_tokens > 0 and report.accepted_tokens <= report.draft_tokens


def test_draft_proposer(pagedllm_tiny_model: Callable[[str], str]) -> None:
    model = pagedllm_tiny_model("llama")
    # The target as its own draft: every draft equals the target's argmax, so all are accepted.
    report = check_proposer("draft", model, speculative={"draft_model": model})
    assert report.accepted_tokens == report.draft_tokens > 0
    assert report.steps_with < report.steps_without


def test_proposer_check_catches_a_silent_proposer(
    pagedllm_component: Register, pagedllm_tiny_model: Callable[[str], str]
) -> None:
    from pagedllm.spec_decode.proposer import Proposals

    class Silent:
        def __init__(self, ctx: Any) -> None:
            pass

        def propose(self, requests: list[Any]) -> Proposals:
            return Proposals([[] for _ in requests], [None for _ in requests])

        def remove_requests(self, req_ids: Any) -> None:
            pass

    pagedllm_component(PluginKind.PROPOSER, "silent", lambda: Silent)
    with pytest.raises(AssertionError, match="proposed no token"):
        check_proposer("silent", pagedllm_tiny_model("llama"))


def test_uniproc_executor(pagedllm_tiny_model: Callable[[str], str]) -> None:
    assert check_executor("uniproc", pagedllm_tiny_model("llama")).tokens_compared > 0


def test_multiproc_executor_two_ranks(pagedllm_tiny_model: Callable[[str], str]) -> None:
    report = check_executor("multiproc", pagedllm_tiny_model("llama"), tensor_parallel_size=2)
    assert report.tensor_parallel_size == 2 and report.tokens_compared > 0


def test_bench_command() -> None:
    assert "throughput" in check_command("bench")


def test_command_check_catches_a_misnamed_subcommand(pagedllm_component: Register) -> None:
    class Misnamed:
        @staticmethod
        def add_parser(subparsers: argparse._SubParsersAction) -> None:
            subparsers.add_parser("other").set_defaults(func=lambda args: 0)

    pagedllm_component(PluginKind.COMMAND, "mine", lambda: Misnamed)
    with pytest.raises(AssertionError, match=r"added \['other'\], not exactly \['mine'\]"):
        check_command("mine")


def test_openai_entrypoint() -> None:
    assert callable(check_entrypoint("openai"))


def test_entrypoint_check_catches_a_wrong_signature(pagedllm_component: Register) -> None:
    pagedllm_component(PluginKind.ENTRYPOINT, "nullary", lambda: (lambda: 0))
    with pytest.raises(AssertionError, match="cannot be called as entry"):
        check_entrypoint("nullary")


def test_example_logits_processor(installed: Path, pagedllm_tiny_model: Callable[[str], str]) -> None:  # noqa: F811
    banned = [7, 9, 11, 13, 17, 19, 23, 29]
    report = check_logits_processor("ban_tokens", pagedllm_tiny_model("llama"), section={"token_ids": banned},
                                    plugin_manager=PluginManager())
    assert report.changed_entries == report.rows * len(banned)
    assert not {t for toks in report.tokens for t in toks} & set(banned)


def test_logits_processor_check_catches_nan(pagedllm_component: Register, pagedllm_tiny_model: Callable[[str], str]) -> None:
    class Poison:
        def __init__(self, ctx: Any) -> None:
            pass

        def apply(self, logits: Any, batch: Any) -> Any:
            logits[:, 0] = float("nan")
            return logits

    pagedllm_component(PluginKind.LOGITS_PROCESSOR, "poison", lambda: Poison)
    with pytest.raises(AssertionError, match="NaN"):
        check_logits_processor("poison", pagedllm_tiny_model("llama"))


@pytest.mark.slow  # starts a Ray cluster (~20 s)
def test_ray_executor(pagedllm_tiny_model: Callable[[str], str]) -> None:
    ray = pytest.importorskip("ray")
    # A small loopback cluster of our own, shut down after, so later tests can start theirs.
    ray.init(num_cpus=2, num_gpus=0, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        report = check_executor("ray", pagedllm_tiny_model("llama"), tensor_parallel_size=2)
    finally:
        ray.shutdown()
    assert report.tokens_compared > 0
