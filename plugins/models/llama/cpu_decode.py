"""One-token decode steps of a Llama model kept quantized on the CPU, as a flat list of C calls.

The module path of one decode token (SmolLM2-135M: 30 layers) makes ~365 nn.Module calls, ~300 new tensors
and views, 30 `split`s and ~360 ctypes calls whose pointers are read from tensors every time: ~5 ms of
single-threaded Python a token, close to the two-thread GEMMs (perf-notes §6, third pass). `CpuDecodePlan` reads every pointer that
does not change between steps once (weights, norm weights, rotary tables, the layer's scratch buffers) and
runs a step as the same C calls, in the same order, on the same inputs:

    per layer   add_rms_norm -> qkv matmul(s) -> rotary -> decode attention (KV write + attend) -> o matmul
                -> add_rms_norm -> gate_up matmul(s) -> silu_and_mul -> down matmul
    after       add_rms_norm (the final norm) into a fresh tensor (the caller keeps it; scratch is reused)

so the hidden states, KV cache and logits are bit for bit those of the module path (tests/test_quant_gguf.py).

NOTE 1: only what the module path would itself have sent to the C kernels is taken: one token, float32, every
linear's quantization method able to bind its one-row product (`bind_row_matmul`, a LinearMethod's optional
member: the gguf method's C kernels without bias at tp 1), the layers exactly Llama's classes (a subclass may
override any piece), and attention impls that run the same C decode kernel (`c_decode_params` and
`c_decode_step`, an AttentionImpl's optional members: the torch backend's with its C decode on). The plan
asks those members and never another plugin's internals. Anything else returns None and the caller runs the
modules.
NOTE 2: a linear of several kernels (pieces of different GGUF types) writes each piece at its column offset
of the one-row output: what `torch.cat` of the pieces holds (the method's bound call does this).
NOTE 3: one C call a step. Where the ops can run a whole step (`bind_decode_step`, a CpuFusedOps's optional
member) and every linear's method gives its product as plain C calls (`row_matmul_c_calls`, optional too),
`run` hands the loop below to C: the same calls, in the same order, on the same buffers. The loop made ~12
ctypes calls a layer, each converting its arguments: with the CPU caches cold from each token's weights,
~1.3 ms of an ~11 ms one-thread token on SmolLM2 (thread CPU time per step, 11.05 -> 9.78 ms). The loop
stays for methods or ops without those members (`one_call` False), and the tests compare the two.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.api.model import RMSNorm


def _c_calls(layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> list[tuple[int, ...]] | None:
    """The layer's one-row product as plain C calls (NOTE 3), or None where its method has none."""
    calls = getattr(getattr(layer, "quant_method", None), "row_matmul_c_calls", None)
    return calls(layer, x, out) if calls is not None else None


def _bound_linear(layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> Any:
    """The layer's one-row product bound to x and out by its quantization method (NOTE 1), or ValueError."""
    bind = getattr(getattr(layer, "quant_method", None), "bind_row_matmul", None)
    run = bind(layer, x, out) if bind is not None else None
    if run is None:
        raise ValueError(f"{type(layer).__name__}: its quantization method has no bound one-row product")
    return run


class CpuDecodePlan:
    """The decode step of one LlamaModel as pre-bound C calls (module docstring); build with `build`."""

    def __init__(self, model: Any, layer_types: tuple[Any, Any, Any]) -> None:
        layer_cls, attn_cls, mlp_cls = layer_types
        norm: RMSNorm = model.norm
        ops = norm.cpu_ops
        assert ops is not None
        self.ops = ops
        self._norm, self._rotary, self._silu, self._attn = ops.norm_fn, ops.rotary_fn, ops.silu_fn, ops.attn_fn
        self.final_norm = (norm.weight.data_ptr(), float(norm.eps), int(norm.gemma))
        self.hidden = int(norm.weight.shape[0])
        first = model.layers[0]
        attn0 = first.self_attn
        self.first_impl: Any = attn0.attn.impl
        h, q, kv, hs = self.hidden, attn0.q_size, attn0.kv_size, attn0.head_dim
        nh, nkv = attn0.num_heads, attn0.num_kv_heads
        inter = first.mlp.down_proj.input_size_per_partition
        rotary = attn0.rotary_emb
        self.rotary_tables = (rotary.cos_cache, rotary.sin_cache)
        # Scratch shared by the layers (one token; every buffer written before it is read in a layer).
        self.normed = torch.empty(1, h)
        self.residual = (torch.empty(1, h), torch.empty(1, h))  # ping-pong: a norm reads one, writes the other
        self.qkv = torch.empty(1, q + 2 * kv)
        self.attn_out = torch.empty(1, nh, hs)
        self.mlp_in = torch.empty(1, h)
        self.gate_up = torch.empty(1, 2 * inter)
        self.act = torch.empty(1, inter)
        self.down = torch.empty(1, h)
        self.o_out = torch.empty(1, h)
        qkv = self.qkv
        self.q3 = qkv[:, :q].view(1, nh, hs)
        self.k3 = qkv[:, q : q + kv].view(1, nkv, hs)
        self.v3 = qkv[:, q + kv :].view(1, nkv, hs)
        row = qkv.stride(0)
        base = qkv.data_ptr()
        self.rotary_args = (base, row, nh, base + 4 * q, row, nkv, hs, 1)
        self.half = int(rotary.cos_cache.shape[-1])
        self.attn_ptrs = (base, row, base + 4 * q, row, base + 4 * (q + kv), row)
        self.layers: list[tuple[Any, ...]] = []
        # NOTE 3: the same layers for the one-call step, None when some product or the ops have no C form.
        c_layers: list[dict[str, Any]] | None = [] if hasattr(ops, "bind_decode_step") else None
        layer: Any
        for layer in model.layers:
            a: Any = layer.self_attn
            m: Any = layer.mlp
            impl = a.attn.impl
            c_params = getattr(impl, "c_decode_params", lambda ops: None)(ops)
            if (
                type(layer) is not layer_cls or type(a) is not attn_cls or type(m) is not mlp_cls
                or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm
                or layer.input_layernorm.cpu_ops is not ops or layer.post_attention_layernorm.cpu_ops is not ops
                or m.act_fn.cpu_ops is not ops or a.rotary_emb is not rotary
                or c_params is None or not hasattr(impl, "c_decode_step") or a.attn.kv_group_id != 0
                or (a.q_size, a.kv_size, a.head_dim, a.num_heads, a.num_kv_heads) != (q, kv, hs, nh, nkv)
                or m.down_proj.input_size_per_partition != inter
            ):
                raise ValueError("not a plain Llama layer kept quantized with the CPU's C kernels")
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            self.layers.append((
                (n1.weight.data_ptr(), float(n1.eps), int(n1.gemma)),
                _bound_linear(a.qkv_proj, self.normed, self.qkv),
                c_params,
                _bound_linear(a.o_proj, self.attn_out.view(1, nh * hs), self.o_out),
                (n2.weight.data_ptr(), float(n2.eps), int(n2.gemma)),
                _bound_linear(m.gate_up_proj, self.mlp_in, self.gate_up),
                _bound_linear(m.down_proj, self.act, self.down),
            ))
            if c_layers is not None:
                products = {name: _c_calls(linear, x, out) for name, linear, x, out in (
                    ("qkv", a.qkv_proj, self.normed, self.qkv), ("o", a.o_proj, self.attn_out.view(1, nh * hs), self.o_out),
                    ("gate_up", m.gate_up_proj, self.mlp_in, self.gate_up), ("down", m.down_proj, self.act, self.down))}
                if any(calls is None for calls in products.values()):
                    c_layers = None
                else:
                    (w1, eps1, g1), (w2, eps2, g2), (scale, window, cap) = self.layers[-1][0], self.layers[-1][4], c_params
                    c_layers.append({"norm1": w1, "eps1": eps1, "gemma1": g1, "norm2": w2, "eps2": eps2, "gemma2": g2,
                                     "scale": scale, "window": window, "soft_cap": cap, **products})
        self.nkv, self.hs, self.nh, self.inter = nkv, hs, nh, inter
        self._c_layers = c_layers
        # Whether run() takes the one-call step (NOTE 3); False runs the Python loop over the same C calls.
        self.one_call = c_layers is not None
        self._c_step: Any = None
        self._c_caches: tuple[Any, ...] = ()

    @classmethod
    def build(cls, model: Any, layer_types: tuple[Any, Any, Any]) -> CpuDecodePlan | None:
        """The plan, or None when the model is not one it covers (NOTE 1)."""
        if getattr(model.norm, "cpu_ops", None) is None or type(model.norm) is not RMSNorm or not len(model.layers):
            return None
        try:
            return cls(model, layer_types)
        except (ValueError, AttributeError, KeyError, TypeError):
            return None

    def run(
        self, hidden: torch.Tensor, positions: torch.Tensor, attn_metadata: Any, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor | None:
        """The final normed hidden state [1, H] of this step, or None when the step is not one it covers."""
        if (
            hidden.shape != (1, self.hidden) or hidden.dtype != torch.float32 or not hidden.is_contiguous()
            or positions.dtype != torch.int64 or not positions.is_contiguous()
        ):
            return None
        common = self.first_impl.c_decode_step(self.q3, self.k3, self.v3, kv_caches[0], attn_metadata)
        if common is None:  # not a step of the C decode kernel (asked as the module path's first layer asks)
            return None
        slots, table, seq_lens = common.slot_mapping, common.block_table, common.seq_lens
        if self.one_call:
            out = torch.empty(1, self.hidden)
            self._bound_step(kv_caches)(hidden.data_ptr(), positions.data_ptr(), slots.data_ptr(), table.data_ptr(),
                                        table.stride(0), seq_lens.data_ptr(), torch.get_num_threads(), out.data_ptr())
            return out
        table_ptr, table_stride = table.data_ptr(), table.stride(0)
        slots_ptr, lens_ptr = slots.data_ptr(), seq_lens.data_ptr()
        cos, sin = self.rotary_tables
        rot = (*self.rotary_args, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), self.half)
        q_ptr, q_row, k_ptr, k_row, v_ptr, v_row = self.attn_ptrs
        nkv, hs, nh = self.nkv, self.hs, self.nh
        norm, rotary, silu, attn = self._norm, self._rotary, self._silu, self._attn
        threads = torch.get_num_threads()
        h, inter = self.hidden, self.inter
        normed, mlp_in, act = self.normed.data_ptr(), self.mlp_in.data_ptr(), self.act.data_ptr()
        o_out, gate_up = self.o_out.data_ptr(), self.gate_up.data_ptr()
        attn_out = self.attn_out.data_ptr()
        res = [r.data_ptr() for r in self.residual]
        x, residual, which = hidden.data_ptr(), 0, 0
        down = self.down.data_ptr()
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        attn_tail = (slots_ptr, table_ptr, table_stride, lens_ptr, 1)
        kv_bf16 = int(kv_caches[0].dtype == torch.bfloat16)  # the C decode attention's cache dtype flag
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            (w1, eps1, g1), qkv, (scale, window, cap), o_proj, (w2, eps2, g2), gate_up_proj, down_proj = layer
            if residual:
                norm(x, residual, w1, eps1, g1, 1, h, normed, res[which])
                residual, which = res[which], 1 - which
            else:  # layer 0: its residual is the embedding itself (LlamaDecoderLayer.forward)
                norm(x, None, w1, eps1, g1, 1, h, normed, None)
                residual = x
            qkv(threads)
            rotary(*rot)
            if attn(q_ptr, q_row, k_ptr, k_row, v_ptr, v_row, kv_cache.data_ptr(), num_blocks, block_size, nkv, hs,
                    nh, *attn_tail, scale, window, cap, attn_out, 1, kv_bf16):  # one request: no threads
                raise MemoryError("cpu_decode_attention: out of memory")
            o_proj(threads)
            norm(o_out, residual, w2, eps2, g2, 1, h, mlp_in, res[which])
            residual, which = res[which], 1 - which
            gate_up_proj(threads)
            silu(gate_up, 1, inter, act)
            down_proj(threads)
            x = down
        out = torch.empty(1, h)
        w, eps, gemma = self.final_norm
        norm(x, residual, w, eps, gemma, 1, h, out.data_ptr(), res[which])  # x + residual: unused, as there
        return out

    def _bound_step(self, kv_caches: list[torch.Tensor]) -> Any:
        """The one-call step bound to these KV caches (bound again when the caches are other tensors)."""
        key = (*(c.data_ptr() for c in kv_caches), kv_caches[0].shape, kv_caches[0].dtype)
        if self._c_step is None or key != self._c_caches:
            layers = self._c_layers
            assert layers is not None
            if len(kv_caches) != len(layers):
                raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} layers")
            _, num_blocks, block_size, _, _ = kv_caches[0].shape
            cos, sin = self.rotary_tables
            w, eps, gemma = self.final_norm
            self._c_step = self.ops.bind_decode_step({
                "layers": [{**layer, "cache": cache.data_ptr()} for layer, cache in zip(layers, kv_caches, strict=True)],
                "hidden": self.hidden, "inter": self.inter, "nh": self.nh, "nkv": self.nkv, "head": self.hs,
                "num_blocks": num_blocks, "block_size": block_size,
                "cos": cos.data_ptr(), "sin": sin.data_ptr(), "half": self.half,
                **{name: getattr(self, name).data_ptr() for name in (
                    "qkv", "attn_out", "normed", "mlp_in", "gate_up", "act", "o_out", "down")},
                "residual": [r.data_ptr() for r in self.residual],
                "final_norm": w, "final_eps": eps, "final_gemma": gemma,
                "kv_bf16": int(kv_caches[0].dtype == torch.bfloat16),
            })
            self._c_caches = key
        return self._c_step
