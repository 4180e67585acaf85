"""check_kv_manager: a single-type KV manager driven as the scheduler drives it, its books checked each step.

The manager serves one KV-cache group of a `KVCacheManager` (the scheduler's door to the cache), over a small
pool so allocations fail, cached blocks are evicted and requests are preempted. A seeded random workload
admits requests (prefix look-up, then slots for a chunk), continues chunked prefills, decodes, preempts and
finishes them; prompts come from a three-token alphabet so prefixes collide and hashes repeat on purpose.
After every operation `KVBooks` checks the pool (kv_invariants.py): ref counts against holders, the free
queue, idle requests holding nothing, append-only block tables, and every prefix hit against the tokens its
blocks were written with. At the end everything is freed and the pool must be whole again (usage 0).

One fixed scenario also checks that caching works at all (for attention specs by default): a request repeating
a finished request's prompt must get a hit.

A cross-attention manager (CrossAttentionSpec) holds each request's encoder output: the workload's requests
then carry random encoder prompts, and the books expect the group to cover the encoder's tokens
(`spec.tokens_to_hold`), not the decoder's; such a manager never caches by design.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedllm.kv_cache.kv_cache_manager import KVCacheConfig, KVCacheGroup, KVCacheManager
from pagedllm.kv_cache.spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SinkSlidingWindowSpec,
    SlidingWindowSpec,
)
from pagedllm.plugin_spec import PluginKind
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.testing.components import find_spec, manager_or_default
from pagedllm.testing.kv_invariants import KVBooks

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager

ALPHABET = (3, 4, 5)
BLOCK_SIZE = 4


@dataclass
class KVManagerReport:
    """Counts from the random workload, to show it exercised what it claims to."""

    manager: str
    operations: int = 0
    admissions: int = 0
    allocation_failures: int = 0
    preemptions: int = 0
    hit_blocks: int = 0
    seeds: list[int] = field(default_factory=list)


def default_spec(spec_type: type, block_size: int = BLOCK_SIZE) -> KVCacheSpec:
    """A small spec of a known type; a manager registered for another spec type must be given one."""
    if spec_type is FullAttentionSpec:
        return FullAttentionSpec(block_size, 1, 8, torch.float32)
    if spec_type is SlidingWindowSpec:
        return SlidingWindowSpec(block_size, 1, 8, torch.float32, sliding_window=6)
    if spec_type is SinkSlidingWindowSpec:  # sinks spanning a block and a half, so a partial sink block is pinned
        return SinkSlidingWindowSpec(block_size, 1, 8, torch.float32, sliding_window=6,
                                     num_sink_tokens=block_size + block_size // 2)
    if spec_type is ChunkedLocalAttentionSpec:  # a chunk of a block and a half: chunk edges inside blocks too
        return ChunkedLocalAttentionSpec(block_size, 1, 8, torch.float32,
                                         attention_chunk_size=block_size + block_size // 2)
    if spec_type is MambaSpec:
        return MambaSpec(block_size, (4, 3), (4, 8), torch.float32)
    if spec_type is CrossAttentionSpec:  # encoder prompts of up to three blocks
        return CrossAttentionSpec(block_size, 1, 8, torch.float32, max_encoder_len=3 * block_size)
    raise TypeError(f"no default spec for {spec_type.__name__}; pass spec=... to check_kv_manager")


def check_kv_manager(
    name: str,
    spec: KVCacheSpec | None = None,
    *,
    num_blocks: int = 14,
    num_operations: int = 250,
    seeds: Sequence[int] = (0, 1, 2),
    expect_prefix_hits: bool | None = None,
    plugin_manager: PluginManager | None = None,
) -> KVManagerReport:
    """Check the KV manager registered as `name` (see the module docstring); AssertionError on a violation.

    `spec` defaults to a small spec of the registration's `spec_type`. `expect_prefix_hits` (default: for
    attention specs) requires that a repeated prompt hits the cache; pass False for a manager that never
    caches by design.
    """
    pm = manager_or_default(plugin_manager)
    registration = find_spec(PluginKind.KV_MANAGER, name, pm)
    manager_cls = registration.resolve()
    if spec is None:
        spec_type = registration.meta.get("spec_type")
        if spec_type is None:
            raise AssertionError(f"kv_manager {name!r} was registered without spec_type=...; the engine cannot pick it")
        spec = default_spec(spec_type)
    encoder_len = spec.max_encoder_len if isinstance(spec, CrossAttentionSpec) else 0
    if expect_prefix_hits is None:
        expect_prefix_hits = isinstance(spec, AttentionSpec) and not encoder_len
    report = KVManagerReport(name, seeds=list(seeds))

    def new_cache() -> KVCacheManager:
        config = KVCacheConfig(num_blocks, [KVCacheGroup(spec, [0])])
        return KVCacheManager(config, [manager_cls], enable_caching=True, max_model_len=4096)

    _repeat_hits(new_cache(), name, spec.block_size, expect_prefix_hits, report, encoder_len)
    for seed in seeds:
        _Workload(new_cache(), f"kv_manager {name!r} (seed {seed})", random.Random(seed), report,
                  encoder_len).run(num_operations)
    return report


def _repeat_hits(
    kv: KVCacheManager, name: str, bs: int, expect: bool, report: KVManagerReport, encoder_len: int = 0
) -> None:
    """A prompt of four full blocks and one token, finished, then asked again with three more tokens."""
    books = KVBooks(kv, f"kv_manager {name!r} (repeated prompt)")
    prompt = list(range(10, 10 + 4 * bs + 1))
    encoder = list(range(20, 20 + encoder_len)) or None
    first = _request("first", prompt, encoder=encoder)
    _admit(kv, books, first, first.num_tokens, "admitting the first request")
    kv.free(first)
    books.released(first.request_id)
    books.check([], [first], "after freeing the first request")
    second = _request("second", prompt + [3, 4, 5], encoder=encoder)
    hits, num_hit = kv.get_computed_blocks(second)
    books.check_hits(second, hits, num_hit, "the repeated prompt")
    if expect and num_hit == 0:
        raise AssertionError(
            f"kv_manager {name!r}: a request repeating a freed request's {len(prompt)}-token prompt got no prefix "
            "hit: prefix caching never reuses a block (pass expect_prefix_hits=False if it does not cache by design)"
        )
    report.hit_blocks += books.hits
    if kv.allocate_slots(second, second.num_tokens - num_hit, num_hit, hits) is None:
        raise AssertionError(f"kv_manager {name!r}: an empty pool refused a request that fits")
    second.num_computed_tokens = second.num_tokens
    books.written(second, second.num_tokens)
    books.check([second], [first], "after admitting the repeated prompt")
    kv.free(second)
    books.check_all_free("after freeing everything")


def _request(rid: str, prompt: list[int], salt: str | None = None, encoder: list[int] | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(), cache_salt=salt, encoder_prompt_token_ids=encoder)


def _admit(kv: KVCacheManager, books: KVBooks, req: Request, chunk: int, where: str) -> bool:
    """What a scheduler does for a waiting request: look up hits, take slots for a chunk after them."""
    hits, num_hit = kv.get_computed_blocks(req)
    books.check_hits(req, hits, num_hit, where)
    num_new = max(1, min(req.num_tokens - num_hit, chunk))
    if kv.allocate_slots(req, num_new, num_hit, hits) is None:
        return False
    req.num_computed_tokens = num_hit + num_new
    books.written(req, req.num_computed_tokens)
    return True


class _Workload:
    """A seeded random scheduler stand-in: add, admit, advance, preempt and finish requests."""

    def __init__(
        self, kv: KVCacheManager, label: str, rng: random.Random, report: KVManagerReport, encoder_len: int = 0
    ) -> None:
        self.kv, self.rng, self.report = kv, rng, report
        self.encoder_len = encoder_len  # the longest encoder prompt; 0: requests have none
        self.books = KVBooks(kv, label)
        self.bs = kv.block_size
        self.running: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}
        self.done: list[Request] = []
        self.counter = 0

    def run(self, num_operations: int) -> None:
        rng = self.rng
        for step in range(num_operations):
            roll = rng.random()
            if roll < 0.2 and len(self.running) + len(self.waiting) < 6:
                op = "adding a request"
                self._add()
            elif roll < 0.45 and self.waiting:
                op = "admitting a request"
                self._admit(self.waiting[rng.choice(sorted(self.waiting))])
            elif roll < 0.85 and self.running:
                op = "advancing a request"
                self._advance(self.running[rng.choice(sorted(self.running))])
            elif roll < 0.93 and self.running:
                op = "finishing a request"
                self._finish(self.running[rng.choice(sorted(self.running))])
            elif self.running:
                op = "preempting a request"
                self._preempt(self.running[rng.choice(sorted(self.running))])
            else:
                continue
            self.report.operations += 1
            self.books.check(self.running.values(), [*self.waiting.values(), *self.done], f"operation {step} ({op})")
        for req in list(self.running.values()):
            self._finish(req)
        self.books.check([], [*self.waiting.values(), *self.done], "after finishing every request")
        self.books.check_all_free("after finishing every request")
        self.report.hit_blocks += self.books.hits

    def _add(self) -> None:
        rng = self.rng
        prompt = [rng.choice(ALPHABET) for _ in range(rng.randint(1, 4 * self.bs + 2))]
        salt = "tenant" if rng.random() < 0.15 else None
        encoder = ([rng.choice(ALPHABET) for _ in range(rng.randint(1, self.encoder_len))]
                   if self.encoder_len else None)
        req = _request(f"r{self.counter}", prompt, salt, encoder)
        self.counter += 1
        self.waiting[req.request_id] = req

    def _admit(self, req: Request) -> None:
        if _admit(self.kv, self.books, req, self.rng.randint(1, 3 * self.bs), f"admitting {req.request_id}"):
            self.report.admissions += 1
            self.running[req.request_id] = self.waiting.pop(req.request_id)
        else:
            self.report.allocation_failures += 1

    def _advance(self, req: Request) -> None:
        if req.num_computed_tokens < req.num_tokens:  # the next chunk of a prefill
            num_new = min(req.num_tokens - req.num_computed_tokens, self.rng.randint(1, 2 * self.bs))
        else:  # a decode step: the token sampled last step is appended, then gets its slot
            req.output_token_ids.append(self.rng.choice(ALPHABET))
            num_new = 1
        if self.kv.allocate_slots(req, num_new) is None:
            self.report.allocation_failures += 1
            self._preempt(req)  # what a scheduler does when a running request cannot grow
            return
        req.num_computed_tokens += num_new
        self.books.written(req, req.num_computed_tokens)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.books.released(req.request_id)
        req.num_computed_tokens = 0
        self.waiting[req.request_id] = self.running.pop(req.request_id)
        self.report.preemptions += 1

    def _finish(self, req: Request) -> None:
        self.kv.free(req)
        self.books.released(req.request_id)
        self.done.append(self.running.pop(req.request_id))

