"""Machinery every executor plugin shares: the tensor-parallel worker (one per remote rank)."""
