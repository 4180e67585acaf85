"""check_model_architecture: the engine's greedy tokens equal transformers' on the same random weights.

transformers builds its model for `hf_config` (random float32 weights, seeded; eager attention, which applies
sliding windows and soft-caps), the checkpoint is saved with `architectures` set to the name under test, and
the engine -- which selects the model class by that name -- generates greedily for a few prompts on the CPU
in float32 with small pages and a small token budget (so chunked prefill, mixed steps and paging all run).
The reference is transformers' greedy decoding (argmax of a full forward per token, EOS ignored: what
`generate(do_sample=False, min_new_tokens=n)` computes, without its logits processors). Tokens must be
identical; a mismatch reports the first differing step and transformers' top-2 logit gap there (a gap near
zero is a near-tie of the random model, not a bug: change the seed or the prompts).
"""

from __future__ import annotations

import copy
import random
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.plugin_spec import PluginKind
from pagedllm.testing.components import find_spec, manager_or_default
from pagedllm.testing.engine_run import run_greedy
from pagedllm.testing.tiny import build_hf_model, save_hf_model

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager


@dataclass
class ModelReport:
    architecture: str
    prompt_lengths: list[int] = field(default_factory=list)
    new_tokens: int = 0
    min_top2_gap: float = float("inf")  # the reference's smallest margin between its top two logits


def check_model_architecture(
    arch: str,
    hf_config: Any,
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 8,
    seed: int = 0,
    perturb_norms: float = 0.1,
    engine_config: Mapping[str, Any] | None = None,
    plugin_manager: PluginManager | None = None,
) -> ModelReport:
    """Check the model registered as `arch` against transformers' model for `hf_config` (a PretrainedConfig).

    `prompts` default to three seeded random prompts of 5, 11 and 23 tokens. `engine_config` adds engine
    config sections (e.g. {"attention": {"backend": "my_backend"}}) to the small CPU engine used.
    """
    pm = manager_or_default(plugin_manager)
    find_spec(PluginKind.MODEL, arch, pm)  # fail early, naming what is registered
    config = copy.deepcopy(hf_config)
    config.architectures = [arch]
    vocab = int(config.vocab_size)
    if prompts is None:
        rng = random.Random(seed)
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 11, 23)]
    report = ModelReport(arch, [len(p) for p in prompts], max_new_tokens)
    hf_model = build_hf_model(config, seed, perturb_norms)
    expected, gaps = zip(*(_hf_greedy(hf_model, p, max_new_tokens) for p in prompts), strict=True)
    report.min_top2_gap = min(min(g) for g in gaps)
    with tempfile.TemporaryDirectory(prefix="pagedllm-testing-") as folder:
        save_hf_model(hf_model, folder, architectures=[arch])
        del hf_model
        got = run_greedy(folder, prompts, max_new_tokens, config=engine_config, plugin_manager=pm).tokens
    for i, (mine, theirs, gap) in enumerate(zip(got, expected, gaps, strict=True)):
        if mine != theirs:
            step = next(j for j, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b)
            raise AssertionError(
                f"model {arch!r}: prompt {i} ({len(prompts[i])} tokens) gave greedy tokens {mine}, transformers "
                f"{theirs}; first difference at step {step}, where transformers' top-2 logit gap is "
                f"{gap[step]:.3g}"
            )
    return report


def _hf_greedy(model: Any, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for `prompt` and, per step, the gap between its two largest logits."""
    ids = torch.tensor([list(prompt)])
    tokens: list[int] = []
    gaps: list[float] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            token = int(logits.argmax())
            tokens.append(token)
            gaps.append(float(top[0] - top[1]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, gaps
