"""The `gguf` quantization method: linear, embedding and LM-head weights stay in GGUF blocks (or a repack).

The block type of each weight is known only when its tensor arrives (a fused qkv may mix Q4_K and Q6_K, as
llama.cpp's "_M" mixes do), so a layer's parameter is a placeholder that collects one `GGUFBlocks` per fused
piece; after loading, consecutive pieces of one type are joined and each run gets a kernel
(`gguf/kernels.py`). The loader sends blocks only when the model's layers use this method; otherwise it
dequantizes at load as before (`quantization: none`). With tensor parallelism each rank keeps its slice of
every piece in blocks (`_rank_slice`): rows for column-parallel pieces and the vocabulary, whole blocks of
columns for row-parallel layers (a split that is not on a block boundary is refused with the reason).

Options (the checkpoint's quantization_config, or `plugins.gguf` in the engine config):

    embedding: "keep" (default) -- the token embedding / LM head in its file type (SmolLM2: Q8_0)
               "int4"           -- requantized to 4 bits per 32-group (asymmetric), ~40% smaller, lossy
    cache_dequantized: false    -- types without a fast kernel: keep a float copy after the first call
    cpu_kernel: "auto" (default) -- Q4_0 / Q4_1 / Q8_0 on the CPU through gguf_cpu.c (built at first use;
                                    aten's int4/int8 kernels, with a warning, where it cannot be built)
                "native"         -- gguf_cpu.c or an error saying why not
                "aten"           -- aten's kernels (bfloat16 activations; the path before gguf_cpu.c)
    dummy_type: "Q4_0" (default) -- `load_format: dummy` (a config.json with quant_method "gguf", no file):
                                    every matrix gets random blocks of this type (gguf_blocks.random_blocks),
                                    drawn on the model's device
    batch_gemm: "float32" (default) -- CPU products of >= 16 rows (prefill, batches): the matrix dequantized
                                    to float32 per call, then a float32 GEMM
                "bfloat16"       -- a bf16 copy of each matrix kept from load, a bf16 GEMM (kernels.py NOTE 4),
                                    from 8 rows on (COPY_GEMM_ROWS: NOTE 6)
                "int8"           -- an int8 copy of each matrix kept from load, int8 activations per 32,
                                    gguf/int8_gemm.c's AVX512-VNNI GEMM (kernels.py NOTE 5), from 2 rows on
                                    (INT8_COPY_ROWS: NOTE 6); the bf16 copy
                                    where that kernel cannot be built (logged)
                                    (not a `plugins.gguf` key: the engine passes it from its `cpu_kernels`,
                                    platform/cpu_compute.py in the core)

On CUDA, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K .. Q6_K run through gguf/triton_gemm.py (TritonKernel); any other
type, or no Triton, falls back to a per-call dequantization, and the reason is logged once per type and kept
on the kernel (`fallback_reason`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.api.loading import (
    DENSE_TYPES,
    F16_FIELDS,
    GGUFBlocks,
    Q,
    decode_blocks,
    dequantize_blocks,
    random_blocks,
)
from pagedllm.api.model import WeightLoadError, set_weight_attrs
from pagedllm.plugins.quantization.gguf.kernels import (
    DenseKernel,
    DequantKernel,
    GroupInt8Kernel,
    Int4PackKernel,
    NativeKernel,
    TritonKernel,
)

logger = logging.getLogger("pagedllm")

_EMBEDDING_MODES = ("keep", "int4")
_CPU_KERNELS = ("auto", "native", "aten")
_BATCH_GEMMS = ("float32", "bfloat16", "int8")
NATIVE_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # what gguf_cpu.c decodes
# What gguf/triton_gemm.py decodes (its TRITON_TYPES; kept here so choosing a kernel does not import triton).
TRITON_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
_logged_fallbacks: set[str] = set()


def triton_reason(ggml_type: Q, device: torch.device) -> str | None:
    """Why TritonKernel cannot run this type on this device, or None when it can."""
    if device.type != "cuda":
        return f"the Triton GGUF kernels run on CUDA, not {device.type}"
    if ggml_type not in TRITON_TYPES:
        return f"{ggml_type.name} has no Triton GGUF kernel (covered: {', '.join(t.name for t in TRITON_TYPES)})"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def make_kernel(
    blocks: GGUFBlocks, dtype: torch.dtype, device: torch.device, cache: bool, native: Any = None
) -> nn.Module:
    """The fastest kernel this device has for one block type (a correct per-call dequantization otherwise).

    `native` is the loaded gguf_cpu.c library (gguf_native.NativeLibrary) or None for aten's kernels.
    """
    t = blocks.ggml_type
    if t in DENSE_TYPES:
        return DenseKernel(blocks.dequantize().to(device=device, dtype=dtype))
    if device.type == "cpu" and native is not None and t in NATIVE_TYPES:
        return NativeKernel(blocks.data, int(t), blocks.shape, native)
    if device.type == "cpu" and t in (Q.Q4_0, Q.Q4_1):
        q, scale, zero = decode_blocks(blocks.data, t, blocks.shape)
        if t == Q.Q4_0:  # decode_blocks centred q; the int4 kernel wants 0..15 and subtracts 8 itself
            return Int4PackKernel(q + 8, scale, torch.zeros_like(scale))
        assert zero is not None
        return Int4PackKernel(q, scale, zero + 8 * scale)
    if device.type == "cpu" and t in (Q.Q8_0, Q.Q5_0, Q.Q5_1):
        return GroupInt8Kernel(*decode_blocks(blocks.data, t, blocks.shape))
    reason = triton_reason(t, device) if device.type == "cuda" else None
    if device.type == "cuda" and reason is None:
        return TritonKernel(blocks.data, int(t), blocks.shape, device)
    # TODO(issue 7): torch K-quant decoding into Int4PackKernel on the CPU.
    kernel = DequantKernel(blocks.data.to(device), t, blocks.shape, cache)
    if reason is not None:
        kernel.fallback_reason = reason
        if reason not in _logged_fallbacks:
            _logged_fallbacks.add(reason)
            logger.warning("gguf: %s; these weights are dequantized on every call", reason)
    return kernel


def requantize_int4(w: torch.Tensor) -> Int4PackKernel:
    """Asymmetric 4-bit, one (scale, min) per 32 inputs, as llama.cpp's Q4_1 rounds: q = round((w - min) / s)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // 32, 32)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = ((groups - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).round().clamp(0, 15).reshape(n, k)
    return Int4PackKernel(q, scale, lo + 8 * scale)


class GGUFConfig:
    """Hands every linear layer a GGUFLinearMethod and the embedding / LM head a GGUFEmbeddingMethod."""

    name = "gguf"

    def __init__(
        self, embedding: str = "keep", cache_dequantized: bool = False, cpu_kernel: str = "auto",
        dummy_type: str = "Q4_0", batch_gemm: str = "float32",
    ) -> None:
        if dummy_type.upper() not in {t.name for t in F16_FIELDS}:
            raise ValueError(f"gguf: dummy_type must be one of {', '.join(t.name for t in F16_FIELDS)}, "
                             f"not {dummy_type!r}")
        self.dummy_type = Q.__members__[dummy_type.upper()]
        if embedding not in _EMBEDDING_MODES:
            raise ValueError(f"gguf: embedding must be one of {_EMBEDDING_MODES}, not {embedding!r}")
        if cpu_kernel not in _CPU_KERNELS:
            raise ValueError(f"gguf: cpu_kernel must be one of {_CPU_KERNELS}, not {cpu_kernel!r}")
        if batch_gemm not in _BATCH_GEMMS:
            raise ValueError(f"gguf: batch_gemm must be one of {_BATCH_GEMMS}, not {batch_gemm!r}")
        self.batch_gemm = batch_gemm
        # GGUFLinearMethod.apply_act_and_mul's NOTE: every linear layer of the model runs its large products on
        # a bf16 copy (cleared at load by the first layer that does not).
        self.every_linear_bf16 = batch_gemm == "bfloat16"
        self._int8_warned = False
        self.embedding = embedding
        self.cache_dequantized = cache_dequantized
        self.cpu_kernel = cpu_kernel

    def cpu_fused_ops(self) -> Any:
        """The CPU fused C kernels (cpu_ops.c: norms, rotary, activation, decode attention) for this model's
        layers, or None (QuantizationConfig's optional member; the engine asks only for a float32 CPU model).

        Kept-quantized outputs are compared with the dequantized model's greedy tokens, not bit for bit, so
        this method may bring kernels that are not bit-identical to torch. Not with the aten kernels, the path
        before gguf_cpu.c (for A/B runs); None too where no C compiler built them.
        """
        if self.cpu_kernel == "aten":
            return None
        from pagedllm.plugins.quantization.gguf.cpu_ops import cpu_ops

        return cpu_ops()

    @classmethod
    def from_config(cls, config: dict[str, Any] | None = None) -> GGUFConfig:
        config = config or {}
        return cls(
            str(config.get("embedding", "keep")),
            bool(config.get("cache_dequantized", False)),
            str(config.get("cpu_kernel", "auto")),
            str(config.get("dummy_type", "Q4_0")),
            str(config.get("batch_gemm", "float32")),
        )

    def native_library(self) -> Any:
        """gguf_cpu.c loaded (built on first use), or None for aten's kernels; "native" insists."""
        if self.cpu_kernel == "aten":
            return None
        from pagedllm.plugins.quantization.gguf.native import native_library, unavailable_reason

        lib = native_library()
        if lib is None and self.cpu_kernel == "native":
            raise RuntimeError(f"gguf: cpu_kernel 'native' requested but unavailable: {unavailable_reason()}")
        return lib

    def int8_library(self) -> Any:
        """gguf/int8_gemm.c loaded (built on first use) for `batch_gemm: int8`, or None (logged once, with why:
        the bf16 copy is kept instead)."""
        from pagedllm.plugins.quantization.gguf.int8_gemm import int8_library, unavailable_reason

        lib = int8_library()
        if lib is None and not self._int8_warned:
            self._int8_warned = True
            logger.warning("gguf: batch_gemm int8 unavailable (%s); large products run the bf16 GEMM",
                           unavailable_reason())
        return lib

    def get_method(self, layer: nn.Module, prefix: str) -> GGUFLinearMethod:
        return GGUFLinearMethod(self)

    def get_embedding_method(self, layer: nn.Module) -> GGUFEmbeddingMethod:
        """For VocabParallelEmbedding / ParallelLMHead (an optional QuantizationConfig hook)."""
        return GGUFEmbeddingMethod(self)


@dataclass
class _LayerState:
    """What the method keeps on a layer while it loads: piece shapes and the pieces received so far."""

    rows: list[int]
    cols: int
    dtype: torch.dtype
    pieces: list[GGUFBlocks | None] = field(default_factory=list)


def _state(layer: nn.Module) -> _LayerState:
    return cast(_LayerState, layer.__dict__["gguf_state"])


def _kernels(layer: nn.Module) -> tuple[nn.Module, ...]:
    """The layer's kernels as a plain tuple (NOTE: per-call cost; the ModuleList keeps them registered)."""
    return cast(tuple[nn.Module, ...], layer.__dict__["gguf_run"])


class _PieceCollector:
    """Shared by the linear and embedding methods: a placeholder `weight` that collects GGUFBlocks pieces."""

    takes_gguf_blocks = True  # the loader sends blocks (not dequantized floats) to models whose layers say so

    def __init__(self, config: GGUFConfig) -> None:
        self.config = config

    def _create_placeholder(self, layer: nn.Module, rows: list[int], cols: int, dtype: torch.dtype) -> None:
        layer.__dict__["gguf_state"] = _LayerState(rows, cols, dtype, [None] * len(rows))
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        # The layer would slice a dense tensor; we take the whole piece, so this loader replaces the layer's.
        set_weight_attrs(weight, {"method_loads": True, "weight_loader": self._loader(layer),
                                  "dummy_load": self._dummy_loader(layer)})
        layer.register_parameter("weight", weight)

    def _dummy_loader(self, layer: nn.Module) -> Any:
        """Dummy weights (loaders/dummy_loader.py): every piece random blocks of `dummy_type`, on the device.

        With tensor parallelism each rank draws its own pieces (not slices of the tp=1 draw)."""

        def load(generator: torch.Generator) -> None:
            state = _state(layer)
            device = cast(torch.Tensor, layer.weight).device
            state.pieces = [random_blocks(self.config.dummy_type, rows, state.cols, generator, device)
                            for rows in state.rows]

        return load

    def _loader(self, layer: nn.Module) -> Any:
        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            piece_index = getattr(layer, "piece_index", None)  # linear layers; an embedding has one piece
            piece = int(piece_index(shard_id)) if piece_index is not None else 0
            if isinstance(loaded, torch.Tensor):  # a dense tensor (F32/F16 in the file, or another loader)
                loaded = GGUFBlocks(loaded.float().contiguous().view(torch.uint8), Q.F32, (int(loaded.shape[0]), int(loaded.shape[1])))
            state = _state(layer)
            expected = (state.rows[piece], state.cols)
            loaded = _rank_slice(layer, loaded, shard_id, expected)
            if tuple(loaded.shape) != expected:
                raise WeightLoadError(f"shape mismatch: parameter piece {expected} vs checkpoint {loaded.shape}")
            state.pieces[piece] = loaded

        return load

    def _build_kernels(self, layer: nn.Module) -> list[tuple[nn.Module, int]]:
        """Join runs of same-type pieces; one kernel per run, with its output width."""
        state = _state(layer)
        device = cast(torch.Tensor, layer.weight).device
        runs: list[list[GGUFBlocks]] = []
        for piece in state.pieces:
            if piece is None:
                raise WeightLoadError("a GGUF layer piece received no tensor")
            if runs and runs[-1][0].ggml_type == piece.ggml_type:
                runs[-1].append(piece)
            else:
                runs.append([piece])
        kernels = []
        for run in runs:
            data = torch.cat([p.data for p in run]) if len(run) > 1 else run[0].data
            blocks = GGUFBlocks(data.cpu(), run[0].ggml_type, (sum(p.shape[0] for p in run), run[0].shape[1]))
            native = self.config.native_library() if device.type == "cpu" else None
            kernel = make_kernel(blocks, state.dtype, device, self.config.cache_dequantized, native)
            if self.config.batch_gemm == "int8" and isinstance(kernel, NativeKernel):
                int8 = self.config.int8_library()
                if int8 is not None:
                    kernel.keep_int8_copy(int8, state.dtype)
                else:
                    kernel.keep_bf16_copy(state.dtype)
            elif self.config.batch_gemm == "bfloat16" and isinstance(kernel, NativeKernel):
                kernel.keep_bf16_copy(state.dtype)
            kernels.append((kernel, blocks.shape[0]))
        return kernels

    def _finish(self, layer: nn.Module, kernels: list[nn.Module]) -> None:
        layer.add_module("gguf_kernels", nn.ModuleList(kernels))
        # NOTE: apply() runs per linear per token; a tuple in __dict__ skips nn.Module.__getattr__ and
        # ModuleList indexing (~3 us a call on the CPU, ~0.5 ms a token for SmolLM2). Same module objects.
        layer.__dict__["gguf_run"] = tuple(kernels)
        _state(layer).pieces = []  # the raw file blocks are no longer referenced: only the kernels stay resident
        weight = cast(torch.Tensor, layer.weight)
        weight.data = torch.empty(0, dtype=torch.uint8, device=weight.device)


def _rank_slice(layer: nn.Module, blocks: GGUFBlocks, shard_id: Any, expected: tuple[int, int]) -> GGUFBlocks:
    """This tensor-parallel rank's part of a whole checkpoint tensor, still in blocks.

    The layer's own weight_loader slices dense tensors; pieces arrive here whole, so the same cuts are made
    on the blocks: output rows for column-parallel pieces (a KV head shared by several ranks is taken by each)
    and for the vocabulary (the last rank's rows padded with zeros), input columns for row-parallel layers.
    """
    tp_size = getattr(layer, "tp_size", 1)
    rows, cols = expected
    if tp_size == 1 or tuple(blocks.shape) == expected:
        return blocks
    rank = int(layer.tp_rank)  # type: ignore[arg-type]
    if blocks.shape[0] != rows:
        vocab_start = getattr(layer, "vocab_start", None)
        if vocab_start is not None:  # vocabulary-parallel embedding / LM head
            length = min(rows, blocks.shape[0] - vocab_start)
            blocks = blocks.narrow_rows(vocab_start, length).pad_rows(rows)
        else:
            replicas = getattr(layer, "num_kv_head_replicas", 1) if shard_id in ("k", "v") else 1
            blocks = blocks.narrow_rows(rank // replicas * rows, rows)
    if blocks.shape[1] != cols:
        blocks = blocks.narrow_cols(rank * cols, cols)
    return blocks


class GGUFLinearMethod(_PieceCollector):
    """QuantizationMethod for linear layers: per-piece blocks at load, one kernel per same-type run."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        self._create_placeholder(layer, list(output_partition_sizes), input_size_per_partition, params_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        kernels = [k for k, _ in self._build_kernels(layer)]
        if not all(isinstance(k, NativeKernel) and k.has_bf16_copy for k in kernels):
            self.config.every_linear_bf16 = False
        self._finish(layer, kernels)

    def apply_act_and_mul(self, layer: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """silu(gate) * up in bf16, straight from this [gate | up] layer's bf16 GEMM, for products of >=
        COPY_GEMM_ROWS rows on bf16 copies (QuantizationMethod's optional member); None elsewhere: apply, then
        the activation.

        NOTE: this skips a float32 round trip -- the [M, 2d] GEMM output widened, SiLU-mul in float32 (one
        thread), its [M, d] output narrowed again for the down projection's bf16 GEMM: SmolLM2's 32 prompts of
        32-256 tokens took 3.5 s of CPU time to prefill instead of 5.1 s (1 thread, 2026-12-02, interleaved in
        one process). The down projection takes the bf16 activation as it is and answers in the model's dtype
        (NativeKernel.keep_bf16_copy), so this runs only while every linear layer has a bf16 copy
        (`every_linear_bf16`): another kernel would answer a bf16 input in bf16. With the CPU fused ops the
        activation is cpu_ops.c's one pass (silu(gate) * up in float32 from the bf16 halves, rounded to bf16
        once: NOTE 7 there); without, torch's, which rounds silu(gate) to bf16 before the product as a bf16
        model's MLP does (teacher-forced top-1 against float32: 300 of 302 positions, 301 with the float32
        SiLU; tests/test_cpu_dtype.py).
        """
        if activation != "silu" or not self.config.every_linear_bf16 or getattr(layer, "bias", None) is not None:
            return None
        kernels = _kernels(layer)
        gate_up = cast(NativeKernel, kernels[0]).bf16_product(x) if len(kernels) == 1 else None
        if gate_up is None:
            return None
        ops = self.config.cpu_fused_ops()
        if ops is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            return cast(torch.Tensor, ops.silu_and_mul_bf16(gate_up))  # one pass, one rounding (cpu_ops.c NOTE 7)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def bind_row_matmul(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> Callable[[int], None] | None:
        """out [1, N] = layer(x [1, K]) as one call with every pointer read now (LinearMethod's optional fast
        path for per-step plans): a run of pieces of different GGUF types writes each piece at its column
        offset, which is what `apply`'s torch.cat holds. None where `apply` does more than that (a bias,
        tensor parallelism)."""
        if getattr(layer, "bias", None) is not None or getattr(layer, "tp_size", 1) != 1 or "gguf_run" not in layer.__dict__:
            return None
        # NOTE: called once per linear per token on the CPU decode path (~120 calls a token for SmolLM2), so
        # the returned call is one closure over pre-bound C calls, as flat as the loop it replaces.
        native: list[tuple[Any, ...]] = []  # (C function, its arguments but the thread count)
        other: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []  # kernel, x, output slice
        offset = 0
        for kernel in _kernels(layer):
            n = int(cast(Any, kernel).n)
            dst = out[:, offset : offset + n]
            if isinstance(kernel, NativeKernel) and dst.is_contiguous():
                native.append(kernel.row_call(x, dst))
            else:
                other.append((kernel, x, dst))
            offset += n
        if offset != out.shape[1]:
            raise ValueError(f"kernels give {offset} outputs, the layer {out.shape[1]}")
        keep = (layer, x, out)  # the bound pointers stay valid while these live

        def run(threads: int, _keep: tuple[Any, ...] = keep) -> None:
            for fn, ggml_type, blocks, n, k, xp, rows, yp in native:
                if fn(ggml_type, blocks, n, k, xp, rows, yp, threads):
                    raise ValueError(f"gguf_matmul: type {ggml_type} with {k} inputs is not supported")
            for kernel, inputs, dst in other:
                dst.copy_(kernel.forward(inputs))

        return run

    def row_matmul_c_calls(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> list[tuple[int, ...]] | None:
        """`bind_row_matmul`'s product as plain C calls, for a plan that runs the whole step in C: one
        (function address, type, weights, n, k, x, y) per piece, each function with gguf_matmul's signature
        (type, weights, n, k, x, rows, y, threads). None where some piece is not such a call."""
        if getattr(layer, "bias", None) is not None or getattr(layer, "tp_size", 1) != 1 or "gguf_run" not in layer.__dict__:
            return None
        calls: list[tuple[int, ...]] = []
        offset = 0
        for kernel in _kernels(layer):
            n = int(cast(Any, kernel).n)
            dst = out[:, offset : offset + n]
            if not isinstance(kernel, NativeKernel) or not dst.is_contiguous():
                return None
            fn, ggml_type, blocks, n, k, xp, _rows, yp = kernel.row_call(x, dst)
            calls.append((cast(int, ctypes.cast(fn, ctypes.c_void_p).value), ggml_type, blocks, n, k, xp, yp))
            offset += n
        if offset != out.shape[1]:
            raise ValueError(f"kernels give {offset} outputs, the layer {out.shape[1]}")
        return calls

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernels = _kernels(layer)
        # Kernels are hook-free leaf modules: calling forward directly skips nn.Module.__call__.
        y = kernels[0].forward(x) if len(kernels) == 1 else torch.cat([k.forward(x) for k in kernels], dim=-1)
        return y + bias if bias is not None else y


class GGUFEmbeddingMethod(_PieceCollector):
    """The token embedding (row lookup) and LM head (matmul) of one quantized [vocab, hidden] matrix."""

    def create_weights(self, layer: nn.Module, rows: int, cols: int, params_dtype: torch.dtype) -> None:
        self._create_placeholder(layer, [rows], cols, params_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        piece = _state(layer).pieces[0]
        if piece is None:
            raise WeightLoadError("the embedding received no tensor")
        if self.config.embedding == "int4" and piece.ggml_type not in (Q.Q4_0, Q.Q4_1):
            kernel: nn.Module = requantize_int4(dequantize_blocks(piece.data, piece.ggml_type, piece.shape))
        else:
            ((kernel, _),) = self._build_kernels(layer)
        self._finish(layer, [kernel])

    def embed(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden] rows in the model dtype."""
        kernel: Any = _kernels(layer)[0]
        return cast(torch.Tensor, kernel.rows(input_ids)).to(_state(layer).dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits."""
        kernel = _kernels(layer)[0]
        logits = cast(torch.Tensor, kernel.forward(x))
        if isinstance(kernel, NativeKernel) and kernel.uses_batch_copy(x):
            # NOTE: a bf16 GEMM rounds each logit to 8 significant bits (0.125 apart at the magnitudes where a
            # real model's top logits sit), so near-ties flip the greedy token; the leading candidates are
            # recomputed in float32 from the exact rows of the blocks (SmolLM2's teacher-forced top-1 agreement
            # with the float32 kernels: 98.7 % without, tests/test_cpu_dtype.py). The int8 GEMM's logits carry
            # the rounding of its int8 activations, so they take the same repair.
            logits = _exact_top_logits(logits, x, kernel, self.config.cpu_fused_ops())
        return logits


_TOP_CANDIDATES = 8  # GGUFEmbeddingMethod.apply's NOTE


def _exact_top_logits(logits: torch.Tensor, x: torch.Tensor, kernel: NativeKernel, ops: Any = None) -> torch.Tensor:
    """float32 logits [N, V] whose leading _TOP_CANDIDATES entries per row are recomputed in float32; `ops`,
    the CPU fused ops, pick them in C (cpu_ops.c NOTE 8: which of equal logits is taken may differ from topk)."""
    out = logits.float()
    k = min(_TOP_CANDIDATES, out.shape[-1])
    if ops is not None and out.dim() == 2 and out.is_contiguous():
        top = ops.top_k(out, k)  # [N, k]
    else:
        top = out.topk(k, dim=-1).indices  # [N, k]
    rows = kernel.rows(top.reshape(-1)).view(*top.shape, -1)  # [N, k, hidden], exact float32
    exact = torch.einsum("nh,nkh->nk", x.float(), rows)
    return out.scatter_(-1, top, exact)
