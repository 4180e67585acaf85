"""The CPU's matrix and vector units, read from the kernel's cpuinfo flags.

The engine's CPU defaults (compute dtype, how GGUF weights are held: platform/cpu_compute.py) follow from what
the processor has, not from its vendor or model name: machines of the same cloud kind differ (an AMD EPYC
with AVX512-BF16 but no AMX, an Intel Xeon with both), and the difference is a 4-5x gap in torch's bf16
matmul. The probe only reads; it never times anything, so it costs nothing at start-up.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

_CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CPUFeatures:
    """The instruction-set extensions this CPU reports (Linux /proc/cpuinfo names) and its core counts."""

    flags: frozenset[str]
    physical_cores: int
    logical_cpus: int
    model_name: str = ""

    @property
    def amx_bf16(self) -> bool:
        """AMX tiles with bf16 dot products (Sapphire Rapids and later): oneDNN's fastest bf16 GEMM."""
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def amx_int8(self) -> bool:
        return {"amx_tile", "amx_int8"} <= self.flags

    @property
    def avx512_bf16(self) -> bool:
        """AVX512 bf16 dot products (vdpbf16ps: Cooper Lake, Sapphire Rapids, AMD Zen 4)."""
        return "avx512_bf16" in self.flags and "avx512f" in self.flags

    @property
    def avx512_vnni(self) -> bool:
        return "avx512_vnni" in self.flags

    @property
    def avx512_int8_dot(self) -> bool:
        """AVX512 int8 dot products on full vectors (vpdpbusd on zmm: AVX512-VNNI with AVX512F/BW), what
        the GGUF int8 batch GEMM (plugins/quantization/gguf/int8_gemm.c) is written for."""
        return {"avx512_vnni", "avx512f", "avx512bw"} <= self.flags

    @property
    def avx512f(self) -> bool:
        return "avx512f" in self.flags

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def bf16_matrix_units(self) -> bool:
        """Whether bf16 matmuls run on hardware bf16 dot products (AMX or AVX512-BF16)."""
        return self.amx_bf16 or self.avx512_bf16

    def summary(self) -> str:
        """The extensions that matter to the CPU kernels, e.g. 'avx512_bf16, avx512_vnni, avx512f, avx2'."""
        names = [
            ("amx_bf16", self.amx_bf16), ("amx_int8", self.amx_int8), ("avx512_bf16", self.avx512_bf16),
            ("avx512_vnni", self.avx512_vnni), ("avx512f", self.avx512f), ("avx2", self.avx2),
        ]
        present = [name for name, has in names if has]
        return ", ".join(present) if present else "none of amx / avx512 / avx2"


def parse_cpuinfo(text: str) -> CPUFeatures:
    """CPUFeatures from /proc/cpuinfo's text (x86: `flags`; the flags of the first processor listed).

    Physical cores are the distinct (physical id, core id) pairs; without those fields (containers that
    hide them, other architectures) every logical CPU counts as a core.
    """
    flags: frozenset[str] = frozenset()
    model = ""
    logical = 0
    cores: set[tuple[str, str]] = set()
    physical_id = core_id = None
    for line in text.splitlines() + [""]:
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            logical += 1
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        elif key == "model name" and not model:
            model = value
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            core_id = value
        elif not line.strip():  # a processor's record ends
            if physical_id is not None and core_id is not None:
                cores.add((physical_id, core_id))
            physical_id = core_id = None
    logical = max(logical, 1)
    return CPUFeatures(flags, len(cores) or logical, logical, model)


# The flags the probe reports instead of the CPU's own, space-separated (e.g. "avx2"): what the engine would
# choose on another processor, for A/B runs and for test suites whose references are float32.
FLAGS_ENV = "PAGEDLLM_CPU_FLAGS"


@functools.cache
def cpu_features() -> CPUFeatures:
    """This machine's CPUFeatures (read once per process); no flags where /proc/cpuinfo cannot be read.
    PAGEDLLM_CPU_FLAGS, when set, replaces the flags (the core counts stay the machine's)."""
    try:
        text = _CPUINFO.read_text()
    except OSError:
        text = ""
    features = parse_cpuinfo(text)
    override = os.environ.get(FLAGS_ENV)
    if override is not None:
        features = CPUFeatures(frozenset(override.split()), features.physical_cores, features.logical_cpus,
                               features.model_name)
    # Cores this process may run on (a container's or taskset's affinity mask) bound the physical count.
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = features.logical_cpus
    if usable < features.physical_cores:
        features = CPUFeatures(features.flags, usable, min(usable, features.logical_cpus), features.model_name)
    return features
