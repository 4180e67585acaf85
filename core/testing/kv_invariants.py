"""The KV pool's books, checked from the outside: shared by the KV-manager and scheduler checks.

`KVBooks` watches one `KVCacheManager` while a driver (a simulated scheduler, or a real one) uses it, and
after each step asserts what must hold whatever the manager's policy:

- ref counts: every real block's `ref_cnt` equals the number of live requests whose block lists hold it;
  a block is in the free queue exactly when nobody holds it; the null block is never handed out;
- idle requests (waiting, preempted, finished) hold no blocks;
- a live request's block lists cover its computed tokens, and only ever grow (an entry may turn into the
  null block -- a released sliding-window block -- but never into another block: the model runner keeps a
  copy of each block table);
- prefix-hit soundness: a hit block was written, in full, with exactly the asking request's tokens (and
  cache salt) up to its end. What each block holds is tracked independently of the pool's hashes, from the
  tokens each request was given slots for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from pagedllm.request import Request


class KVBooks:
    """Independent bookkeeping of one KV cache; raises AssertionError (prefixed with `label`) on a violation."""

    def __init__(self, kv: KVCacheManager, label: str) -> None:
        self.kv = kv
        self.label = label
        self.block_sizes: list[int] = list(kv.coordinator.block_sizes)
        self.null_id = kv.block_pool.null_block.block_id
        # (group, block id) -> (cache salt, the tokens from position 0 to the block's last written slot)
        self.content: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.hits = 0  # hit blocks seen (real ones, not null placeholders)

    # -- what the driver reports ------------------------------------------------------------------------------

    def written(self, request: Request, num_tokens: int) -> None:
        """`request` now has slots (and, once its step runs, KV) for its first `num_tokens` tokens."""
        tokens = request.all_token_ids
        for g, blocks in enumerate(self.kv.get_blocks(request.request_id).blocks):
            bs = self.block_sizes[g]
            for i, block in enumerate(blocks):
                end = min((i + 1) * bs, num_tokens)
                if block.is_null or end <= i * bs:
                    continue
                self.content[(g, block.block_id)] = (request.cache_salt, tuple(tokens[:end]))

    def check_hits(self, request: Request, hits: KVCacheBlocks, num_hit: int, where: str) -> None:
        """A prefix hit (get_computed_blocks' answer) must be whole blocks of exactly the request's tokens."""
        what = f"{self.label}: {where}: prefix hit of {num_hit} tokens for request {request.request_id!r}"
        if num_hit < 0 or num_hit > max(request.num_tokens - 1, 0):
            raise AssertionError(f"{what}: must be 0 .. num_tokens - 1 = {request.num_tokens - 1} (the last "
                                 "token is always recomputed, for its logits)")
        tokens = request.all_token_ids
        for g, blocks in enumerate(hits.blocks):
            bs = self.block_sizes[g]
            if len(blocks) * bs != num_hit:
                raise AssertionError(f"{what}: group {g} returned {len(blocks)} blocks of {bs} tokens")
            for i, block in enumerate(blocks):
                if block.is_null:
                    continue
                expected = (request.cache_salt, tuple(tokens[: (i + 1) * bs]))
                held = self.content.get((g, block.block_id))
                if held != expected:
                    shown = "nothing written" if held is None else (
                        f"{len(held[1])} tokens {_short(held[1])} (salt {held[0]!r})")
                    raise AssertionError(
                        f"{what}: block {block.block_id} at index {i} holds {shown}, but the request's first "
                        f"{(i + 1) * bs} tokens are {_short(expected[1])} (salt {expected[0]!r}): a hit must "
                        "be a full block whose tokens, and every token before them, match"
                    )
                self.hits += 1

    def released(self, request_id: str) -> None:
        """The request gave its blocks back (finished, aborted or preempted): its tables start over."""
        self.tables.pop(request_id, None)

    # -- the invariants ---------------------------------------------------------------------------------------

    def check(self, live: Iterable[Request], idle: Iterable[Request], where: str) -> None:
        """Every invariant of the module docstring, for `live` requests (hold blocks) and `idle` ones (none)."""
        kv, pool = self.kv, self.kv.block_pool
        prefix = f"{self.label}: {where}"
        held: Counter[int] = Counter()
        for request in live:
            rid = request.request_id
            groups = kv.get_blocks(rid).blocks
            for block in (b for blocks in groups for b in blocks if not b.is_null):
                held[block.block_id] += 1
            self._check_table(request, [[b.block_id for b in blocks] for blocks in groups], prefix)
        for request in idle:
            ids = [i for g in kv.get_block_ids(request.request_id) for i in g if i != self.null_id]
            if ids:
                raise AssertionError(
                    f"{prefix}: request {request.request_id!r} is {request.status.name} but still holds blocks "
                    f"{ids}: a request that is not running must have given every block back"
                )
        free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
        if self.null_id in free:
            raise AssertionError(f"{prefix}: the null block {self.null_id} is in the free queue")
        for block in pool.blocks:
            if block.block_id == self.null_id:
                continue
            holders = held[block.block_id]
            if block.ref_cnt != holders:
                raise AssertionError(
                    f"{prefix}: block {block.block_id} has ref_cnt {block.ref_cnt} but {holders} running "
                    "request(s) hold it"
                )
            if (block.ref_cnt == 0) != (block.block_id in free):
                state = "held but in the free queue" if block.ref_cnt else "held by nobody and not in the free queue (leaked)"
                raise AssertionError(f"{prefix}: block {block.block_id} is {state}")
        if len(free) != pool.get_num_free_blocks():
            raise AssertionError(
                f"{prefix}: the free queue holds {len(free)} blocks but reports {pool.get_num_free_blocks()}"
            )

    def check_all_free(self, where: str) -> None:
        """Nothing held any more: every block back in the free queue, usage 0."""
        pool = self.kv.block_pool
        usable = pool.num_blocks - 1
        if pool.get_num_free_blocks() != usable or self.kv.usage != 0.0:
            held = [b.block_id for b in pool.blocks if b.ref_cnt and not b.is_null]
            raise AssertionError(
                f"{self.label}: {where}: {pool.get_num_free_blocks()} of {usable} blocks free (usage "
                f"{self.kv.usage:.2f}); still held: {held}"
            )

    def _check_table(self, request: Request, table: list[list[int]], prefix: str) -> None:
        rid = request.request_id
        for g, ids in enumerate(table):
            bs = self.block_sizes[g]
            # A cross-attention group holds the encoder's tokens instead (spec.tokens_to_hold).
            spec = self.kv.config.groups[g].spec
            need = spec.tokens_to_hold(request.num_computed_tokens, request.num_encoder_tokens)
            if len(ids) * bs < need:
                raise AssertionError(
                    f"{prefix}: request {rid!r} has {request.num_computed_tokens} computed tokens ({need} slots to "
                    f"hold in group {g}) but group {g} holds only {len(ids)} blocks of {bs}"
                )
        before = self.tables.get(rid)
        if before is not None:
            for g, (old, new) in enumerate(zip(before, table, strict=True)):
                changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b and b != self.null_id]
                if len(new) < len(old) or changed:
                    raise AssertionError(
                        f"{prefix}: request {rid!r}'s block table in group {g} went from {old} to {new}: block "
                        "lists may only grow (or release an entry to the null block) while a request holds them"
                    )
        self.tables[rid] = table


def _short(tokens: tuple[int, ...] | Any) -> str:
    text = str(list(tokens))
    return text if len(text) <= 60 else text[:57] + "...]"
