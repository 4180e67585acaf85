"""Helpers for model tests: tiny random HF checkpoints and a miniature paged runner over our model."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
from pagedllm.plugins.loaders.hf.loader import HFLoader
from pagedllm.protocols.model import ModelBuildContext
from pagedllm.worker.input_prep import prepare_inputs


def make_hf_model(config: Any, seed: int = 0) -> torch.nn.Module:
    """A transformers model with every weight random and O(1) logits (HF's init leaves biases at zero and
    logits tiny, which would make the comparisons weak)."""
    import transformers

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    cls = getattr(transformers, config.architectures[0])
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embed" in name:
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 0.15)
    return model


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits of the transformers model over the whole sequence."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def load_ours(path: str, block_size: int = 4) -> tuple[torch.nn.Module, ModelBuildContext]:
    """Our model for the HF folder at `path`: float32, CPU, torch backend, loaded through HFLoader."""
    from pagedllm.plugins.models.llama.model import LlamaForCausalLM
    from pagedllm.plugins.models.llama.qwen2 import Qwen2ForCausalLM
    from pagedllm.plugins.models.llama.qwen3 import Qwen3ForCausalLM

    classes = {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
    }
    loader = HFLoader()
    info = loader.load_info(path)
    ctx = ModelBuildContext(
        hf_config=info.hf_config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attn_backend=TorchSDPABackend,
        quant_config=None,
        block_size=block_size,
    )
    model = classes[info.hf_config.architectures[0]](ctx)
    loader.load_weights(model, path, info)
    return model.eval(), ctx


@dataclass
class PagedRunner:
    """Just enough of a model runner: a paged cache with shuffled block ids, per-request block lists and
    computed counts, and one `step` per scheduler decision. Returns the logits of every scheduled row."""

    model: torch.nn.Module
    block_size: int = 4
    num_blocks: int = 64
    seed: int = 0
    caches: list[torch.Tensor] = field(init=False)
    free_blocks: list[int] = field(init=False)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.caches = [
            torch.zeros(
                TorchSDPABackend.kv_cache_shape(
                    self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_size
                ),
                dtype=spec.dtype,
            )
            for spec in self.model.kv_cache_specs()  # type: ignore[operator]
        ]
        # Shuffled so a request's blocks are scattered: the paging is really exercised.
        self.free_blocks = list(range(1, self.num_blocks))
        random.Random(self.seed).shuffle(self.free_blocks)

    def step(self, batch: list[tuple[str, list[int], int]]) -> list[torch.Tensor]:
        """batch: (request id, all known tokens, tokens to schedule), decodes first. Per request: [n, vocab]."""
        for req_id, _tokens, n in batch:
            blocks = self.blocks.setdefault(req_id, [])
            needed = -(-(self.computed.get(req_id, 0) + n) // self.block_size)
            while len(blocks) < needed:
                blocks.append(self.free_blocks.pop())
        num_decodes = 0
        while num_decodes < len(batch) and batch[num_decodes][2] == 1:
            num_decodes += 1
        inputs = prepare_inputs(
            token_ids=[tokens for _, tokens, _ in batch],
            num_computed=[self.computed.get(req_id, 0) for req_id, _, _ in batch],
            num_scheduled=[n for _, _, n in batch],
            block_ids=[self.blocks[req_id] for req_id, _, _ in batch],
            block_size=self.block_size,
            device=torch.device("cpu"),
            num_decodes=num_decodes,
        )
        metadata = TorchSDPABackend.build_metadata(inputs.attn)
        with torch.no_grad():
            hidden = self.model(inputs.input_ids, inputs.positions, metadata, self.caches)
            logits = self.model.compute_logits(hidden)  # type: ignore[operator]
        assert logits.dtype in (torch.float32, hidden.dtype)  # the ModelProtocol.compute_logits contract
        # The runner samples from logits_indices; they must be each request's last row.
        assert torch.equal(logits[inputs.logits_indices], logits[inputs.attn.query_start_loc[1:].long() - 1])
        for req_id, _, n in batch:
            self.computed[req_id] = self.computed.get(req_id, 0) + n
        return list(logits.split([n for _, _, n in batch]))
