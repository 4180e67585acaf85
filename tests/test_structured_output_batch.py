"""The grammar manager's batch paths: many requests' tokens accepted on threads and many masks filled at once
must give exactly what one request at a time gives (structured_output/manager.py accept_rows / fill_rows)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("xgrammar")

from structured_models import smollm2_tokenizer  # noqa: E402

from pagedllm.protocols.structured_output import StructuredOutputContext  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.bitmask import bitmask_width  # noqa: E402
from pagedllm.structured_output.manager import accept_rows, fill_rows  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
N = 70  # past the threshold (64) where xgrammar's accepts go to threads


def _allowed(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    bits = ((bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def test_batch_accept_on_threads_and_batch_fill_equal_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.plugins.structured_output.xgrammar import backend as xg

    monkeypatch.setattr(xg, "_ACCEPT_THREADS", 3)  # this machine may have too few cores to use them
    tokenizer = smollm2_tokenizer()
    vocab = len(tokenizer)
    be = xg.XgrammarBackend(StructuredOutputContext(tokenizer, vocab, (int(tokenizer.eos_token_id),)))
    compiled = be.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    batched = [be.make_grammar(compiled) for _ in range(N)]
    single = [be.make_grammar(compiled) for _ in range(N)]
    rng = random.Random(0)
    width = bitmask_width(vocab)
    steps = 0
    while steps < 40 and not all(g.is_terminated() for g in single):
        live = [i for i in range(N) if not single[i].is_terminated()]
        a = torch.zeros((N, width), dtype=torch.int32)
        b = torch.zeros((N, width), dtype=torch.int32)
        fill_rows([(batched[i], i) for i in live], a)
        for i in live:
            single[i].fill_bitmask(b, i)
        assert torch.equal(a[live], b[live])
        # One allowed token per request, sometimes a forbidden one: both paths must refuse it alike.
        tokens = [[rng.choice(_allowed(b, i, vocab)) if rng.random() > 0.05 else 0] for i in live]
        got = accept_rows([(str(i), batched[i], t) for i, t in zip(live, tokens)])
        want = [single[i].accept_tokens(str(i), t) for i, t in zip(live, tokens)]
        assert got == want
        for i, ok in zip(live, want):
            if not ok:  # a refused token leaves the matcher unspecified: start both again
                batched[i], single[i] = be.make_grammar(compiled), be.make_grammar(compiled)
        assert [g.is_terminated() for g in batched] == [g.is_terminated() for g in single]
        steps += 1
    assert steps >= 10
