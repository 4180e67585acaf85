"""The chunked greedy argmax (core/sample/argmax_kernel.py) against torch.argmax, under Triton's interpreter,
and its dispatch rule (greedy_argmax.py).

Kernel cases run in a child process (this file as a script: TRITON_INTERPRET is set before triton is
imported). Every case must give torch.argmax's index exactly: ties across and within chunks (the lowest
index wins), NaNs (the first NaN wins), all -inf rows (index 0), a ragged last chunk, a vocabulary past
MAX_CHUNKS chunks of the smallest block; float32 and float16 (the interpreter's bf16 math is wrong, so bf16
is left to the GPU check, examples/gpu/small_gemv_check.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from typing import Any

import pytest
import torch
from interpreter_child import run_interpreted

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cases: dict[str, torch.Tensor] = {}
    cases["fp32_ragged_tail"] = torch.randn(1, 9000, generator=g)
    rows = torch.randn(5, 20000, generator=g)
    rows[0, 3] = rows[0, 17000] = 9.0  # a tie across chunks: 3
    rows[1, 4097] = rows[1, 4100] = 9.0  # a tie inside one chunk: 4097
    rows[2, 19999] = 9.0  # the very last logit
    rows[3, 7000] = float("nan")  # a NaN beats every number
    rows[3, 12] = float("inf")
    rows[4] = float("-inf")  # all -inf: index 0
    cases["fp32_ties_nan_inf"] = rows
    two_nans = torch.randn(2, 12000, generator=g)
    two_nans[0, 9000] = two_nans[0, 300] = float("nan")  # the first NaN: 300
    two_nans[1, :] = float("-inf")
    two_nans[1, 11999] = -1e30  # the one finite value
    cases["fp32_two_nans_one_finite"] = two_nans
    coarse = (torch.randn(3, 33000, generator=g) * 4).round().to(torch.float16)  # many exact ties
    cases["fp16_many_ties"] = coarse
    cases["fp16_wide_vocab"] = torch.randn(2, 300_000, generator=g).to(torch.float16)  # a 4096-logit block
    return cases


def _run() -> dict[str, Any]:
    from pagedllm.layers import split_k
    from pagedllm.sample import argmax_kernel

    results: dict[str, Any] = {}
    for name, logits in _cases().items():
        got = argmax_kernel.argmax_rows(logits)
        again = argmax_kernel.argmax_rows(logits)
        results[name] = {"got": got.tolist(), "again": again.tolist(), "dtype": str(got.dtype),
                         "block": argmax_kernel.chunk_block(logits.shape[1])}
    strided = torch.randn(40, 9000).T.contiguous().T[:3]  # rows of a transposed copy: stride (1, 40) -> refused
    results["strided_refused"] = False
    try:
        argmax_kernel.argmax_rows(strided)
    except AssertionError:
        results["strided_refused"] = True
    tickets = split_k._TICKETS.get(torch.device("cpu"))
    results["tickets_zero"] = tickets is None or int(tickets.abs().sum()) == 0
    return results


@functools.cache
def _results() -> dict[str, Any]:
    return dict(run_interpreted(__file__))


@needs_triton
@pytest.mark.parametrize("name", list(_cases()))
def test_argmax_equals_torch(name: str) -> None:
    want = _cases()[name].argmax(dim=-1).tolist()
    got = _results()[name]
    assert got["dtype"] == "torch.int64"
    assert got["got"] == want and got["again"] == want, (got, want)


@needs_triton
def test_wide_vocab_takes_a_wider_block_and_tickets_return_to_zero() -> None:
    got = _results()
    assert got["fp16_wide_vocab"]["block"] == 4096 and got["fp32_ragged_tail"]["block"] == 2048
    assert got["tickets_zero"] and got["strided_refused"], got


@pytest.mark.parametrize("name", list(_cases()))
def test_cpu_chunked_argmax_equals_torch(name: str) -> None:
    """The CPU's chunk-maxima argmax (greedy_argmax.py NOTE 1) on the kernel's cases: ties, NaNs, -inf rows,
    ragged tails; also bf16, a strided view and a tail that ties with (or is a NaN after) the main part."""
    from pagedllm.sample import greedy_argmax as rule

    logits = _cases()[name]
    assert logits.shape[1] >= rule.MIN_VOCAB
    for x in (logits, logits.to(torch.bfloat16), torch.cat([logits, logits], dim=1)[:, 3 : 3 + logits.shape[1]]):
        assert torch.equal(rule.greedy_argmax(x), x.argmax(dim=-1)), name


def test_cpu_chunked_argmax_tail_rules() -> None:
    from pagedllm.sample import greedy_argmax as rule

    vocab = 9 * rule.CPU_CHUNK + 100
    x = torch.zeros(4, vocab)
    x[0, 5], x[0, vocab - 1] = 3.0, 3.0  # a tie with the tail: the lower index
    x[1, vocab - 2] = 3.0  # the tail strictly greater
    x[2, vocab - 3] = float("nan")  # a NaN in the tail beats every number before it
    x[3, 7], x[3, vocab - 1] = float("nan"), float("nan")  # the first NaN
    assert rule.greedy_argmax(x).tolist() == x.argmax(dim=-1).tolist() == [5, vocab - 2, vocab - 3, 7]


def test_rule_keeps_cpu_small_vocab_and_odd_layouts_on_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only CUDA [B <= MAX_ROWS, V >= MIN_VOCAB] rows take the kernel; the sampler's greedy path calls the rule."""
    from pagedllm.sample import greedy_argmax as rule
    from pagedllm.sample.metadata import SamplingMetadata  # noqa: F401  (the sampler imports cleanly)
    from pagedllm.sample.sampler import Sampler  # noqa: F401

    x = torch.randn(2, rule.MIN_VOCAB - 1)
    assert torch.equal(rule.greedy_argmax(x), x.argmax(dim=-1))  # a CPU vocabulary under MIN_VOCAB: torch's own
    taken: list[tuple[int, ...]] = []
    monkeypatch.setattr("pagedllm.sample.argmax_kernel.argmax_rows",
                        lambda t: taken.append(tuple(t.shape)) or t.argmax(dim=-1), raising=False)

    class FakeCuda(torch.Tensor):
        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return torch.device("cuda", 0)

    for shape, wanted in (((1, rule.MIN_VOCAB), True), ((rule.MAX_ROWS, 2 * rule.MIN_VOCAB), True),
                          ((1, rule.MIN_VOCAB - 1), False), ((rule.MAX_ROWS + 1, rule.MIN_VOCAB), False)):
        taken.clear()
        t = torch.randn(*shape).as_subclass(FakeCuda)
        rule.greedy_argmax(t)
        assert bool(taken) == wanted, shape


if __name__ == "__main__":
    print(json.dumps(_run()))
