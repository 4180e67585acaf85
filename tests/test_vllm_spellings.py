"""vLLM's spellings of engine options (issue 25 item 5), offline and on the command line: code and scripts
ported from vLLM keep working, and `trust_remote_code` is refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.cli.main import main
from pagedllm.config import ConfigError, flat_overrides

ENGINE = dict(device="cpu", block_size=4, kv_cache_memory_gb=0.01)


def test_speculative_config_ngram_and_draft(tiny_root: Path) -> None:
    model = make_tiny_model("llama", tiny_root)
    # 24 tokens: the random model's output starts repeating itself, which is what n-gram lookup drafts from.
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8] * 4}
    with LLM(model, **ENGINE) as plain:
        expected = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
             **ENGINE) as llm:
        spec = llm.engine.config.speculative
        assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 2, 3)
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert llm.get_stats().spec_num_draft_tokens > 0
    # vLLM: a draft `model` (method omitted, or "draft_model") is draft-model speculation.
    assert flat_overrides(speculative_config={"model": "/d", "num_speculative_tokens": 4}) == {
        "speculative.draft_model": "/d", "speculative.num_speculative_tokens": 4, "speculative.method": "draft"}
    assert flat_overrides(speculative_config='{"method": "draft_model", "model": "/d"}')["speculative.method"] == "draft"


def test_speculative_config_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match="speculative.draft_tensor_parallel_size"):
        LLM(speculative_config={"method": "ngram", "draft_tensor_parallel_size": 2})


def test_trust_remote_code() -> None:
    with pytest.raises(ConfigError, match="trust_remote_code: pagedllm never runs model code"):
        LLM(trust_remote_code=True)
    assert flat_overrides(trust_remote_code=False) == {}  # what pagedllm always does


def _shown(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["config", "show", *args]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_cli_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert _shown(["--no-enable-prefix-caching"], capsys)["kv_cache"]["enable_prefix_caching"] is False
    assert _shown(["--enable-prefix-caching"], capsys)["kv_cache"]["enable_prefix_caching"] is True
    assert _shown(["--no-prefix-caching"], capsys)["kv_cache"]["enable_prefix_caching"] is False
    assert _shown(["--enforce-eager"], capsys)["enforce_eager"] is True
    spec = _shown(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'], capsys)["speculative"]
    assert (spec["method"], spec["num_speculative_tokens"]) == ("ngram", 5)
    assert main(["config", "show", "--trust-remote-code"]) == 2
    assert "trust_remote_code: pagedllm never runs model code" in capsys.readouterr().err
    assert main(["config", "show", "--speculative-config", "{not json"]) == 2
    assert "speculative_config: not valid JSON" in capsys.readouterr().err
