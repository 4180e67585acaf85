"""Tensor-parallel process groups and the collectives the model layers call (torch.distributed)."""
