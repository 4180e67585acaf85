"""The token bitmask's Triton kernel (core/structured_output/bitmask_triton.py) against xgrammar's own
`apply_token_bitmask_inplace` on the CPU, run by Triton's interpreter in a child process (this file as a
script; TRITON_INTERPRET must be set before triton is imported). Vocabularies that are not a multiple of 32
nor of the kernel's block, random words (so every bit pattern, the sign bit included), the whole batch and
an indexed subset of rows, fp32 and fp16 logits."""

from __future__ import annotations

import importlib.util
import sys

import pytest

CASES = {
    "whole_fp32": {"vocab": 1000, "rows": 4, "indexed": False, "dtype": "float32"},
    "indexed_fp32": {"vocab": 5000, "rows": 6, "indexed": True, "dtype": "float32"},
    "indexed_fp16": {"vocab": 4127, "rows": 5, "indexed": True, "dtype": "float16"},
}


def _run(case: dict) -> bool:
    import torch
    import xgrammar as xgr

    from pagedllm.structured_output.bitmask import allocate_bitmask
    from pagedllm.structured_output.bitmask_triton import apply_bitmask_triton

    gen = torch.Generator().manual_seed(case["vocab"])
    vocab, n, dtype = case["vocab"], case["rows"], getattr(torch, case["dtype"])
    logits = torch.randn(n + 2, vocab, generator=gen).to(dtype)
    bitmask = allocate_bitmask(n, vocab)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int64).to(torch.int32))
    expected = logits.clone()
    if case["indexed"]:
        rows, mask_rows = list(range(n + 2))[::-1][:n], [(i * 3) % n for i in range(n)]
        reference = expected[rows].float().contiguous()
        xgr.apply_token_bitmask_inplace(reference, bitmask[mask_rows].contiguous())
        expected[rows] = reference.to(dtype)
        apply_bitmask_triton(logits, bitmask, torch.tensor(rows), torch.tensor(mask_rows))
    else:
        logits, expected = logits[:n].contiguous(), expected[:n].contiguous()
        reference = expected.float()
        xgr.apply_token_bitmask_inplace(reference, bitmask)
        expected = reference.to(dtype)
        apply_bitmask_triton(logits, bitmask, None, None)
    return bool(torch.equal(logits, expected))


@pytest.fixture(scope="module")
def interpreted() -> dict:
    from interpreter_child import run_interpreted

    return run_interpreted(__file__)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernel_masks_what_xgrammar_masks(interpreted: dict, name: str) -> None:
    assert interpreted[name] is True


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_kernel_compiles_for_sm90() -> None:
    """Through Triton's compiler for sm_90 (offline: no GPU), over bf16, fp16 and fp32 logits, indexed or not."""
    from offline_compile import compile_offline

    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.structured_output import bitmask_triton as t\n"
        "fn = t._apply_bitmask\n"
        "for dt, indexed in (('bf16', True), ('fp16', False), ('fp32', True)):\n"
        "    cons = dict(BLOCK=t.BLOCK, INDEXED=indexed)\n"
        "    ptrs = {'logits_ptr': '*' + dt, 'mask_ptr': '*i32', 'logit_rows_ptr': '*i64', 'mask_rows_ptr': '*i64'}\n"
        "    sig = {a: 'constexpr' if a in cons else ptrs.get(a, 'i32') for a in fn.arg_names}\n"
        "    keys = {(fn.arg_names.index(k),): v for k, v in cons.items()}\n"
        "    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys), target=GPUTarget('cuda', 90, 32),\n"
        "                   options={'num_warps': 4})\n"
        "print('ok')\n"
    )
    compile_offline(code)


if __name__ == "__main__":
    import json

    sys.stdout.flush()
    print(json.dumps({name: _run(case) for name, case in CASES.items()}))
