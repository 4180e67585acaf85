"""Programmatic dependent launch switches (core/layers/pdl.py) and the trigger in the fused ops' kernels."""

from __future__ import annotations

import importlib.util

import pytest
from offline_compile import compile_offline

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_pdl_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from pagedllm.layers import pdl

    assert not pdl.pdl_on(torch.zeros(2), "w4a16") and not pdl.trigger_on(torch.zeros(2))  # CPU: never
    cases = ((("TRITON_INTERPRET", "1"),), (("PAGEDLLM_PDL", "0"),), (("PAGEDLLM_PDL", "none"),),
             (("PAGEDLLM_PDL", "dense"),))
    for env in cases:
        pdl._pdl_on.cache_clear()
        pdl._pdl_kernels.cache_clear()
        with monkeypatch.context() as m:
            m.delenv("TRITON_INTERPRET", raising=False)
            m.delenv("PAGEDLLM_PDL", raising=False)
            for key, value in env:
                m.setenv(key, value)
            # decided before the device is asked for its capability: no GPU is needed to see the switch
            assert pdl._pdl_on(0, "w4a16") is False, env
    with monkeypatch.context() as m:
        for raw, kernels in (("all", {"w4a16", "dense"}), ("w4a16, dense", {"w4a16", "dense"}),
                             ("off", set()), (None, set(pdl.PDL_KERNELS))):
            pdl._pdl_kernels.cache_clear()
            if raw is None:
                m.delenv("PAGEDLLM_PDL", raising=False)
            else:
                m.setenv("PAGEDLLM_PDL", raw)
            assert pdl._pdl_kernels() == kernels, raw
        pdl._pdl_kernels.cache_clear()
        m.setenv("PAGEDLLM_PDL", "w4a16,gguf")
        with pytest.raises(ValueError, match="PAGEDLLM_PDL='w4a16,gguf': unknown \\['gguf'\\]"):
            pdl._pdl_kernels()
    pdl._pdl_kernels.cache_clear()
    pdl._pdl_on.cache_clear()


def test_fused_ops_trigger_their_dependents_only_with_pdl() -> None:
    """RMSNorm and act_and_mul through Triton for sm_90 (offline): launch_dependents first, only with PDL."""
    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.layers import triton_ops as t\n"
        "for fn, cons in ((t._rms_norm_kernel, dict(BLOCK=4096, HAS_RESIDUAL=True, GEMMA=False)),\n"
        "                 (t._act_and_mul_kernel, dict(BLOCK=1024, GELU_TANH=False))):\n"
        "    for pdl in (False, True):\n"
        "        c = dict(cons, PDL=pdl)\n"
        "        sig = {a: 'constexpr' if a in c else '*bf16' if a.endswith('_ptr') else\n"
        "               'fp32' if a == 'eps' else 'i32' for a in fn.arg_names}\n"
        "        keys = {(fn.arg_names.index(k),): v for k, v in c.items()}\n"
        "        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys),\n"
        "                             target=GPUTarget('cuda', 90, 32), options={'num_warps': 4}).asm['ptx']\n"
        "        assert ('griddepcontrol.launch_dependents' in ptx) == pdl, (fn, pdl)\n"
        "        if pdl:\n"
        "            assert ptx.index('griddepcontrol.launch_dependents') < ptx.index('ld.global')\n"
        "print('ok')\n"
    )
    compile_offline(code)
