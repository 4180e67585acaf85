"""Which data-parallel replica gets a request: prefix-cache affinity first, unless that replica is busier.

    prompt ─► first block of token ids ─► hash ─► preferred replica (stable: same first block, same replica)
           └─ shorter than a block: no preference

    pick = preferred   if it is healthy and its load <= the least load + `slack`
           least loaded healthy replica otherwise (ties broken round-robin, so a burst spreads evenly)

Load is the number of requests the frontend has in flight on a replica (its queue plus its running batch),
counted here as requests are assigned and finish, so picking never waits for a replica to answer.
NOTE 1: affinity pays only while the replica still holds that prefix's KV blocks; the slack bounds how much
imbalance is traded for it (vLLM's and SGLang's routers make the same trade with a load threshold).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence


class NoHealthyReplicaError(RuntimeError):
    """Every replica has been marked unhealthy."""


class ReplicaBalancer:
    def __init__(self, num_replicas: int, block_size: int, slack: int = 4) -> None:
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, not {num_replicas}")
        self.block_size = block_size
        self.slack = slack
        self.load = [0] * num_replicas
        self.healthy = [True] * num_replicas
        self._turn = itertools.count()

    def preferred(self, prompt_token_ids: Sequence[int]) -> int | None:
        """The replica a prompt's first full block hashes to (None for a prompt shorter than a block)."""
        if len(prompt_token_ids) < self.block_size:
            return None
        first = ",".join(map(str, prompt_token_ids[: self.block_size])).encode()
        # Not hash(): it is salted per process, and the same prefix must map to the same replica in every
        # frontend process (several API servers may share the replicas).
        digest = hashlib.blake2b(first, digest_size=8).digest()
        return int.from_bytes(digest, "little") % len(self.load)

    def pick(self, prompt_token_ids: Sequence[int]) -> int:
        """Choose a replica for a new request and count it in that replica's load."""
        alive = [i for i, ok in enumerate(self.healthy) if ok]
        if not alive:
            raise NoHealthyReplicaError("no healthy data-parallel replica is left")
        least = min(self.load[i] for i in alive)
        choice = self.preferred(prompt_token_ids)
        if choice is None or not self.healthy[choice] or self.load[choice] > least + self.slack:
            idle = [i for i in alive if self.load[i] == least]
            choice = idle[next(self._turn) % len(idle)]
        self.load[choice] += 1
        return choice

    def finished(self, replica: int) -> None:
        """One of the replica's requests ended (finished, aborted or failed)."""
        self.load[replica] = max(0, self.load[replica] - 1)

    def mark_unhealthy(self, replica: int) -> None:
        self.healthy[replica] = False
        self.load[replica] = 0
