"""The CPU's compute defaults, chosen from what the processor has (platform/cpu_features.py).

Three choices, each returned with the reason `pagedllm config show --resolve` and the start-up log print:

1. The compute dtype for `dtype: auto` on the CPU: bfloat16 where the CPU has bf16 dot products (AMX-BF16 or
   AVX512-BF16), float32 otherwise. Weights, activations and the KV cache then share that dtype; oneDNN runs
   the bf16 GEMMs on those units.
2. For a GGUF file kept quantized (`cpu_kernels`, EngineConfig): which GEMM its large products (prefill,
   batches of >= 8 rows; >= 2 for int8) run -- a bf16 GEMM on a bf16 copy of each matrix made at load where the CPU has bf16
   dot products and the copy fits (NOTE 3), else the matrix dequantized to float32 per call; on request an int8
   GEMM on an int8 copy (NOTE 4); smaller decode batches stay on gguf_cpu.c's kernels.
3. The KV cache's dtype for `kv_cache.cache_dtype: auto` (NOTE 5): bfloat16 for a float32 model kept
   quantized whose large products already run bf16 (choice 2 on bf16 hardware), the model's dtype otherwise;
   its attention reads the bf16 cache and computes in float32.

NOTE 1: measured on an AMD EPYC (Zen 4: AVX512-BF16, no AMX; 2 cores, loaded), 2026-12-01: torch's bf16 GEMM
ran 1.8-3.6x its float32 GEMM at SmolLM2's shapes for 32-256 rows, but one-row bf16 products carry ~40 us of
fixed cost (576 x 576: 50 us against float32's 30 us), so single-stream decode is no faster in bf16 at that
size. A dense model therefore runs in bf16 where the units exist (the bigger the matrices, the more bf16's
halved bytes win at one row too: 4096 x 4096 ran 13.5 ms against 18.2 ms); a GGUF model keeps its C kernels
for decode (faster than either dense GEMV there) and can take bf16 for the large products: SmolLM2's
32-prompt batch ran 1.5x faster and its time to first token 2x, decode unchanged (docs/cpu.md has the runs).
NOTE 3: `cpu_kernels: auto` takes the bf16 GEMMs where the CPU has bf16 units. They round: bf16 prefill moves
the hidden states enough to flip a near-tied first token, e.g. README's first command (SmolLM2, "What is the
capital of France?": "The" at logprob -1.88 against "L" at -1.97 in float32) answers "L'Étoile, ..." instead
of float32's "The capital of France is Paris." -- which is also what llama.cpp itself answers on the same file
(its CPU kernels quantize the activations to 8 bits), so the float32 answer was the near-tie's luck, not the
file's reference behaviour. Teacher-forced top-1 agrees with float32 on 99.3 % of positions
(tests/test_cpu_dtype.py holds it >= 99 %); `cpu_kernels: quantized` keeps every product in float32.
NOTE 4: `cpu_kernels: int8` (where the CPU has AVX512-VNNI with AVX512BW) runs the large products on the int8
GEMM of plugins/quantization/gguf/int8_gemm.c: the weights' exact 4-bit values (with their per-32 scales)
against activations rounded to int8 per 32 values (llama.cpp's Q8_1), multiplied by vpdpbusd, twice
vdpbf16ps's multiply-adds per instruction. SmolLM2's matrices at 32-256 rows ran 1.5-2.6x the packed oneDNN
bf16 GEMM on one core of a Zen 4 EPYC (tools/bench_cpu_gemm.py; docs/cpu.md has the runs). The int8 copy
replaces the bf16 one (about 0.6x its size). It is not auto's choice: int8 activations round ~5x coarser than
bf16 (max|x| / 254 of a 32-block against 2^-9 of each value), and SmolLM2's teacher-forced top-1 agreed with
float32 on 292 of 302 positions (96.7 %, bf16: 300) -- below the 99 % that `auto` holds its kernels to
(tests/test_cpu_dtype.py, tests/test_gguf_int8_gemm.py). Activations rounded to 16 bits as two int8 halves
(int8_gemm.c NOTE 4) agree but ran 0.83-1.1x the bf16 GEMM, so they are not used.
NOTE 5: `kv_cache.cache_dtype: auto` (KV_CACHE_BF16_FOR_QUANTIZED). A batch's decode attention reads every
request's whole context every step, from memory (the cache does not stay in L3 behind the weights): SmolLM2's
128-request batch read the float32 cache at ~31 of the machine's ~40 GB/s. A bf16 cache halves those bytes;
the `cpu` attention backend's kernels round K/V to bf16 as they write them and widen them in registers as
they read them (plugins/attention/cpu/backend.py NOTE 4). Only where the model already rounds to bf16: a
quantized float32 model whose batch GEMMs are bf16 (`cpu_kernels` auto on bf16 units, or bf16 / int8), so the
cache adds rounding of the size its prefill products have; `cpu_kernels: quantized` (float32 throughout), a CPU
without bf16 units, and a dense float32 model (greedy tokens equal transformers') keep a float32 cache; a bf16
model's cache is bf16 already. The kernels need no bf16 units (the widening is a shift). Teacher-forced top-1 and the timings behind the default are in docs/cpu.md ("A bf16 KV cache");
tests/test_cpu_dtype.py holds the top-1 agreement to >= 99 %. `kv_cache.cache_dtype: float32` keeps float32.
NOTE 2: the bf16 copy costs memory: SmolLM2-135M's Q4_1 weights (97 MB) gain 270 MB. It is made only when it
takes at most half the memory available at start-up, so a model that fits only quantized still loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pagedllm.platform.cpu_features import CPUFeatures
from pagedllm.platform.host_memory import host_memory

CpuKernels = Literal["auto", "quantized", "bf16", "int8"]
# NOTE 2: the share of available memory a bf16 (or int8) copy of the weights may take.
DEQUANTIZED_MEMORY_SHARE = 0.5
# NOTE 4: the int8 copy's size against the bf16 copy's: a byte a weight and two float32 per 32 (1.25 / 2).
INT8_COPY_SHARE = 0.625
# NOTE 5: whether `kv_cache.cache_dtype: auto` stores a quantized float32 model's K/V in bf16.
KV_CACHE_BF16_FOR_QUANTIZED = True


@dataclass(frozen=True)
class CpuChoice:
    """One choice and why it was made (a sentence naming the flag or key that decided it)."""

    value: str
    reason: str


def resolve_cpu_dtype(requested: str, quantization: str, features: CPUFeatures) -> CpuChoice:
    """The CPU compute dtype for the config's `dtype` and the chosen quantization method's name.

    Only an unquantized model follows the probe: GGUF's kept-quantized C kernels (and the CPU fused ops that
    come with them) take float32 activations, and the other methods' CPU paths are float32 references.
    """
    if requested != "auto":
        return CpuChoice(requested, f"dtype: {requested} (config)")
    if quantization != "none":
        return CpuChoice("float32", f"dtype auto: quantization {quantization} on the CPU runs float32 activations")
    return choose_cpu_dtype(features)


def choose_cpu_dtype(features: CPUFeatures) -> CpuChoice:
    """`dtype: auto` on the CPU: bfloat16 on hardware bf16 dot products, float32 otherwise."""
    if features.amx_bf16:
        return CpuChoice("bfloat16", "dtype auto: the CPU has AMX-BF16 (bf16 GEMMs on its matrix tiles through oneDNN)")
    if features.avx512_bf16:
        return CpuChoice("bfloat16", "dtype auto: the CPU has AVX512-BF16 (bf16 dot products through oneDNN)")
    have = features.summary()
    return CpuChoice("float32", f"dtype auto: no AMX-BF16 or AVX512-BF16 on this CPU ({have}): float32")


def choose_gguf_batch_gemm(
    features: CPUFeatures, requested: CpuKernels, bf16_copy_bytes: int | None, available_bytes: int | None
) -> CpuChoice:
    """Which GEMM a kept-quantized GGUF model's large products (>= 8 rows, int8 >= 2: prefill, batches) run on the CPU:
    'bfloat16' (a bf16 copy of each matrix made at load), 'int8' (an int8 copy, int8 activations: NOTE 4) or
    'float32' (each matrix dequantized per call).

    :param requested: the config's `cpu_kernels` ('auto' lets this rule decide (NOTE 3); 'quantized' =
        float32; 'bf16' / 'int8' ask for that copy).
    :param bf16_copy_bytes: the bf16 copy's size (an estimate), None when unknown; the int8 copy takes
        INT8_COPY_SHARE of it.
    :param available_bytes: the memory available now, None when unknown.
    """
    if requested == "quantized":
        return CpuChoice("float32", "cpu_kernels: quantized (config): every product on the GGUF blocks")
    config = " (config)" if requested != "auto" else ""
    int8 = requested == "int8"  # NOTE 4: not auto's choice
    if int8 and not features.avx512_int8_dot:
        return CpuChoice(
            "float32", f"cpu_kernels: int8 (config), but this CPU has no AVX512-VNNI with AVX512BW "
            f"({features.summary()}): every product on the GGUF blocks",
        )
    if requested == "auto" and not features.bf16_matrix_units:
        return CpuChoice(
            "float32",
            f"cpu_kernels auto: no AMX-BF16 or AVX512-BF16 on this CPU ({features.summary()}): every "
            "product on the GGUF blocks",
        )
    copy_bytes = None if bf16_copy_bytes is None else int(bf16_copy_bytes * (INT8_COPY_SHARE if int8 else 1))
    kind = "an int8" if int8 else "a bf16"
    too_big = copy_bytes is not None and available_bytes is not None and (
        copy_bytes > DEQUANTIZED_MEMORY_SHARE * available_bytes
    )
    if too_big:
        assert copy_bytes is not None and available_bytes is not None
        return CpuChoice(
            "float32",
            f"cpu_kernels: {requested}{config}, but {kind} copy of the weights ({copy_bytes / 2**30:.1f} GiB) would "
            f"take more than {DEQUANTIZED_MEMORY_SHARE:.0%} of the {available_bytes / 2**30:.1f} GiB available: "
            "every product on the GGUF blocks",
        )
    if int8:
        return CpuChoice(
            "int8",
            "cpu_kernels: int8 (config): products of >= 2 rows run int8 GEMMs (vpdpbusd, activations rounded to "
            "int8 per 32 as llama.cpp does: NOTE 4) on an int8 copy of the weights made at load; decode stays on the "
            "GGUF C kernels",
        )
    why = (
        f"cpu_kernels auto: the CPU has {'AMX-BF16' if features.amx_bf16 else 'AVX512-BF16'} (NOTE 3)"
        if requested == "auto" else "cpu_kernels: bf16 (config)"
    )
    return CpuChoice(
        "bfloat16",
        f"{why}: products of >= 8 rows run bf16 GEMMs on a bf16 copy of the weights made at load; decode stays on "
        "the GGUF C kernels",
    )


def choose_cpu_kv_cache_dtype(
    requested: str, dtype: str, quantization: str, features: CPUFeatures, cpu_kernels: CpuKernels
) -> CpuChoice:
    """The CPU KV cache's dtype (NOTE 5): 'auto' (the model's) or a dtype name, with why.

    :param requested: the config's `kv_cache.cache_dtype` (normalised: 'auto', 'bfloat16', 'float32', ...).
    :param dtype: the model's compute dtype ('float32', 'bfloat16').
    :param quantization: the chosen quantization method's name ('none' for a dense model).
    :param cpu_kernels: the config's `cpu_kernels` (the batch GEMM of a GGUF model kept quantized).
    """
    if requested != "auto":
        return CpuChoice(requested, f"kv_cache.cache_dtype: {requested} (config)")
    if dtype != "float32":
        return CpuChoice("auto", f"kv_cache.cache_dtype auto: the model's {dtype}")
    if quantization == "none":
        return CpuChoice(
            "auto", "kv_cache.cache_dtype auto: a dense float32 model keeps a float32 cache (its greedy tokens are "
            "transformers')",
        )
    if not KV_CACHE_BF16_FOR_QUANTIZED:
        return CpuChoice("auto", f"kv_cache.cache_dtype auto: float32 for quantization {quantization} (NOTE 5)")
    if cpu_kernels == "quantized":
        return CpuChoice("auto", "kv_cache.cache_dtype auto: float32 with cpu_kernels: quantized (float32 throughout)")
    if cpu_kernels == "auto" and not features.bf16_matrix_units:
        return CpuChoice(
            "auto", f"kv_cache.cache_dtype auto: float32 (no AMX-BF16 or AVX512-BF16 on this CPU: the batch GEMMs "
            f"stay float32 too; {features.summary()})",
        )
    return CpuChoice(
        "bfloat16",
        f"kv_cache.cache_dtype auto: bfloat16 for a float32 model kept quantized ({quantization}) with bf16 batch "
        "GEMMs: half the bytes a decode step's attention reads, computed in float32 (NOTE 5; "
        "kv_cache.cache_dtype: float32 keeps float32)",
    )


def dense_weight_bytes(hf_config: Any, itemsize: int) -> int | None:
    """The decoder's linear and embedding weights' size at `itemsize` bytes an element (a Llama-shaped
    estimate from the config: attention, gated MLP, embedding and untied LM head), None without the sizes."""
    try:
        hidden = int(hf_config.hidden_size)
        layers = int(hf_config.num_hidden_layers)
        vocab = int(hf_config.vocab_size)
        heads = int(hf_config.num_attention_heads)
        inter = int(getattr(hf_config, "intermediate_size", 4 * hidden))
    except (AttributeError, TypeError, ValueError):
        return None
    head = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    per_layer = hidden * head * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    embeddings = vocab * hidden * (1 if getattr(hf_config, "tie_word_embeddings", False) else 2)
    return (layers * per_layer + embeddings) * itemsize


def default_num_threads(features: CPUFeatures, env: Mapping[str, str]) -> int | None:
    """torch's intra-op threads when the config names none: one per physical core this process may use
    (hyperthread siblings share the core's matrix units, so a second thread there only adds a straggler to
    every op's barrier); None where OMP_NUM_THREADS / TORCH_NUM_THREADS already say how many."""
    if env.get("OMP_NUM_THREADS") or env.get("TORCH_NUM_THREADS"):
        return None
    return max(1, features.physical_cores)


def available_memory_bytes() -> int | None:
    """The memory this process may take now (MemAvailable, bounded by its cgroup's limit: host_memory.py),
    None where neither can be read."""
    return host_memory().available_bytes
