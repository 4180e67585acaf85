"""Beam search (`LLM.beam_search`, `use_beam_search` on /v1/completions) against transformers'
`generate(num_beams=4, early_stopping=True, do_sample=False)`: the same beams, in the same order, with the
same scores, for prompts whose beams all run to max_tokens and for prompts whose beams end in EOS.

The tiny random Llama (fp32, wide init: peaked logits, so no near-tie decides a rank) gets a second variant
whose EOS row of lm_head is scaled up, so EOS is among the top candidates within a few steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import make_tiny_model

from pagedllm import LLM
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

EOS = 2  # tiny_models' eos_token_id
WIDTH = 4
PROMPTS = [[1, 5, 9, 33, 70], [1, 200, 17], [1, 42, 42, 300, 7, 8, 9, 100, 101], [1, 10, 20, 30, 40, 50]]


@pytest.fixture(scope="module")
def plain_dir(tiny_root: Path) -> str:
    return make_tiny_model("llama", tiny_root)


@pytest.fixture(scope="module")
def eos_dir(plain_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with its EOS logit doubled: beams end within a few tokens, at different lengths."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 2.0
    path = tmp_path_factory.mktemp("beam_eos") / "llama-eos"
    model.save_pretrained(path)
    return str(path)


def _llm(model_dir: str, **kw: Any) -> LLM:
    return LLM(model_dir, device="cpu", block_size=4, num_kv_blocks=256, max_num_seqs=64, num_threads=1, **kw)


def _hf_beams(model_dir: str, prompt: list[int], width: int, max_new: int,
              length_penalty: float = 1.0) -> tuple[list[list[int]], list[float]]:
    """transformers' returned beams (generated ids, EOS kept, padding cut) and their sequence scores."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), num_beams=width, num_return_sequences=width, early_stopping=True,
            max_new_tokens=max_new, do_sample=False, length_penalty=length_penalty, pad_token_id=EOS,
            return_dict_in_generate=True, output_scores=True,
        )
    beams = []
    for row in out.sequences.tolist():
        gen = row[len(prompt):]
        # Finished beams shorter than the longest are padded with pad_token_id (= EOS here): cut after the first.
        beams.append(gen[: gen.index(EOS) + 1] if EOS in gen else gen)
    return beams, [float(s) for s in out.sequences_scores]


def _check_against_hf(model_dir: str, outputs: list[Any], max_new: int, length_penalty: float = 1.0) -> None:
    for prompt, out in zip(PROMPTS, outputs):
        hf_beams, hf_scores = _hf_beams(model_dir, prompt, WIDTH, max_new, length_penalty)
        ours = [s.generated for s in out.sequences]
        assert ours == hf_beams, f"prompt {prompt}"
        assert [s.score for s in out.sequences] == pytest.approx(hf_scores, abs=1e-4)
        for s in out.sequences:
            assert s.tokens[: len(prompt)] == prompt
            assert s.finish_reason == ("stop" if s.generated[-1] == EOS else "length")
            assert s.cum_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(s.logprobs, s.generated)))


def test_equals_transformers_without_eos(plain_dir: str) -> None:
    max_new = 8
    outputs = _llm(plain_dir).beam_search(PROMPTS, BeamSearchParams(beam_width=WIDTH, max_tokens=max_new))
    assert all(len(s.generated) == max_new for o in outputs for s in o.sequences)  # no beam met EOS
    _check_against_hf(plain_dir, outputs, max_new)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
def test_equals_transformers_with_eos(eos_dir: str, length_penalty: float) -> None:
    max_new = 10
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=max_new, length_penalty=length_penalty)
    outputs = _llm(eos_dir).beam_search(PROMPTS, params)
    reasons = [s.finish_reason for o in outputs for s in o.sequences]
    lengths = {len(s.generated) for o in outputs for s in o.sequences}
    # The case this test exists for: beams that end in EOS, at several lengths, next to beams cut at max_tokens
    # (so the early stop, the EOS ranking rule and the length penalty all decide something).
    assert "stop" in reasons and "length" in reasons and len(lengths) >= 3
    _check_against_hf(eos_dir, outputs, max_new, length_penalty)


def test_width_one_is_greedy(plain_dir: str) -> None:
    llm = _llm(plain_dir)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6))
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=6),
                          use_tqdm=False)
    assert [b.sequences[0].generated for b in beams] == [list(g.outputs[0].token_ids) for g in greedy]


def test_ignore_eos_runs_every_beam_to_max_tokens(eos_dir: str) -> None:
    outputs = _llm(eos_dir).beam_search(PROMPTS, BeamSearchParams(beam_width=WIDTH, max_tokens=6, ignore_eos=True))
    assert all(s.finish_reason == "length" and len(s.generated) == 6 for o in outputs for s in o.sequences)
    assert any(EOS in s.generated for o in outputs for s in o.sequences)  # EOS was generated, and did not stop


def test_beams_share_prefix_blocks_and_free_them(plain_dir: str) -> None:
    llm = _llm(plain_dir)
    llm.beam_search(PROMPTS, BeamSearchParams(beam_width=WIDTH, max_tokens=12))
    stats = llm.get_stats()
    # Each step's beams extend the last step's by one token: most of every prompt is a prefix-cache hit.
    assert stats.prefix_cache_hits > 0.5 * stats.prefix_cache_queries
    assert llm.engine.kv_cache_usage == 0.0


def test_bad_input_is_refused(plain_dir: str) -> None:
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    llm = _llm(plain_dir, max_model_len=32)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=30))
