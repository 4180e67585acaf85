"""Token embedding and LM head, both split along the vocabulary across tensor-parallel ranks.

The vocabulary is padded up to a multiple of tp_size so every rank holds the same number of rows:

    rank r owns token ids [r * V_part, (r + 1) * V_part), V_part = ceil(V / tp); rows >= V are zero padding.

A quantization config may keep the matrix quantized: if it has the optional hook
`get_embedding_method(layer)`, the returned method owns the weight (`create_weights(layer, rows, cols,
dtype)` with this rank's padded row count, `embed(layer, local_ids)` for the lookup, `apply(layer, x)` for the
LM head's local logits), and a tied LM head multiplies by the embedding's quantized copy; the masking,
all-reduce and all-gather stay here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.communication import tp_all_gather, tp_all_reduce
from pagedllm.layers.weight_utils import WeightLoadError, copy_checked, set_weight_attrs
from pagedllm.protocols.model import ModelBuildContext


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split across ranks; each rank looks up its own ids and the sum is all-reduced."""

    def __init__(self, ctx: ModelBuildContext, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = ctx.tp_rank
        self.tp_size = ctx.tp_size
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // ctx.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        hook = getattr(ctx.quant_config, "get_embedding_method", None)
        self.quant_method: Any = hook(self) if hook is not None else None
        if self.quant_method is not None:
            self.quant_method.create_weights(self, self.num_embeddings_per_partition, embedding_dim, ctx.dtype)
            return
        self.weight = nn.Parameter(
            torch.zeros(self.num_embeddings_per_partition, embedding_dim, dtype=ctx.dtype),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's rows of the [vocab, hidden] checkpoint tensor; padding rows stay zero."""
        if shard_id is not None:
            raise WeightLoadError(f"embeddings take no shard id (got {shard_id!r})")
        if loaded_weight.shape[0] != self.num_embeddings:
            raise WeightLoadError(
                f"vocab size {loaded_weight.shape[0]} in checkpoint, {self.num_embeddings} in config"
            )
        rows = self.vocab_end - self.vocab_start
        copy_checked(param.data[:rows], loaded_weight[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]."""
        if self.tp_size == 1:
            return self._lookup(input_ids)
        # Ids owned by other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        rows = self._lookup(torch.where(owned, input_ids - self.vocab_start, 0))
        return tp_all_reduce(rows * owned.unsqueeze(-1).to(rows.dtype), self.tp_size)

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's part of the matrix (dense, or through the quantization method)."""
        if self.quant_method is not None:
            return self.quant_method.embed(self, local_ids)  # type: ignore[no-any-return]
        return F.embedding(local_ids, self.weight)


# NOTE: a bf16 GEMM rounds each logit to 8 significant bits: 0.125 apart at magnitudes 16-32, where the top
# logits of a real model sit, so near-ties flip the greedy token. Recomputing the few leading candidates in
# float32 (from the same bf16 weights) costs a top-k and TOP_CANDIDATES dot products a row, and raised SmolLM2's
# teacher-forced top-1 agreement with its float32 model from 98.3 % to 99.7 % (tests/test_cpu_dtype.py).
TOP_CANDIDATES = 8


def exact_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 logits [N, V] whose TOP_CANDIDATES leading entries per row are recomputed in float32."""
    out = logits.float()
    top = out.topk(min(TOP_CANDIDATES, out.shape[-1]), dim=-1).indices  # [N, k]
    exact = torch.einsum("nh,nkh->nk", hidden.float(), weight[top].float())
    return out.scatter_(-1, top, exact)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> vocab logits; may share its weight with the embedding (tie_word_embeddings).

    A dense head multiplies through the build's dense method (ModelBuildContext.dense_config: the engine's
    decode GEMV on CUDA), as the dense linear layers do.
    """

    def __init__(self, ctx: ModelBuildContext, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(ctx, num_embeddings, embedding_dim)
        from pagedllm.layers.linear import dense_method

        self.dense_method = dense_method(ctx, self, "lm_head")

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Use the embedding's parameter as ours (one tensor, loaded once from embed_tokens)."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError("cannot tie embeddings of different shapes")
        self.weight = embedding.weight
        if self.quant_method is not None:
            # Our own placeholder is gone; the logits come from the embedding's quantized copy.
            self.quant_method = None
            self.tied_embedding = embedding

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model dtype (padding columns dropped)."""
        source = getattr(self, "tied_embedding", self)
        if source.quant_method is not None:
            logits = source.quant_method.apply(source, hidden_states)
        else:
            logits = self.dense_method.apply(self, hidden_states, None)
            if logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.dim() == 2:
                logits = exact_top_logits(logits, hidden_states, self.weight)
        logits = tp_all_gather(logits, self.tp_size, dim=-1)
        return logits[..., : self.num_embeddings]
