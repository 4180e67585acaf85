"""CUDA C kernels compiled at first use with NVRTC and launched through the driver, for the few kernels Triton
cannot express (tensor-core fragments built in registers: plugins/quantization/w4a16_mma.cu).

    compile_cubin(source, name, arch)   NVRTC -> a cubin for one real architecture (no driver JIT); works on a
                                        machine without a GPU (the CPU tests compile the sources this way)
    load_kernel(source, name, device)   compile for the device's architecture, load, cache: a CUfunction handle
    launch(kernel, grid, block, args)   cuLaunchKernel / cuLaunchKernelEx (pdl=True) on the current stream

NOTE 1 (which NVRTC): torch's CUDA wheels depend on the `nvidia-cuda-nvrtc` package; its library is found
by soname (loaded already or on the loader path), else under site-packages/nvidia/*/lib, else at
$PAGEDLLM_NVRTC. The cubin is built for the device's own sm_XY ("a" suffix from sm_90: the kernels use no
arch-specific instruction, but the suffix costs nothing and lets them), so nothing is JIT-compiled at load.
NOTE 2 (launch): torch.cuda._utils loads the module; `launch` calls the driver on torch's current stream, so
a launch inside torch.cuda.graph() is captured like any other kernel (a PDL launch as a programmatic edge).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import site
import sys
from typing import Any

_NVRTC_SUCCESS = 0


class RtcError(RuntimeError):
    """NVRTC is missing or a source failed to compile (the message carries NVRTC's log)."""


def _candidates() -> list[str]:
    """$PAGEDLLM_NVRTC, then sonames, then wheel folders; torch's own CUDA major first (a cubin from a newer
    NVRTC may not load under the driver torch was built for)."""
    import torch

    majors = [13, 12]
    if torch.version.cuda:
        own = int(torch.version.cuda.split(".")[0])
        majors = [own] + [m for m in majors if m != own]
    names = [os.environ.get("PAGEDLLM_NVRTC", "")]
    names += [f"libnvrtc.so.{major}" for major in majors] + ["libnvrtc.so"]
    found: list[str] = []
    for root in [*site.getsitepackages(), site.getusersitepackages(), *sys.path]:
        found += glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*"))
    rank = {major: i for i, major in enumerate(majors)}
    found.sort(key=lambda path: min((rank[m] for m in majors if path.endswith(f".so.{m}") or f".so.{m}." in path),
                                    default=len(majors)))
    names += found
    return [n for n in dict.fromkeys(names) if n and "builtins" not in n and ".alt." not in n]


@functools.cache
def nvrtc() -> ctypes.CDLL:
    """The NVRTC library (NOTE 1); RtcError when none loads."""
    tried = []
    for name in _candidates():
        try:
            # NVRTC dlopens its builtins library by soname at compile time: load it first from the same
            # folder, so a wheel's lib folder need not be on the loader path.
            for builtins in sorted(glob.glob(os.path.join(os.path.dirname(name), "libnvrtc-builtins.so*"))):
                if os.path.dirname(name) and ".alt." not in builtins:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(name)
        except OSError:
            tried.append(name)
    raise RtcError(f"NVRTC not found (tried {', '.join(tried[:6])}...); install nvidia-cuda-nvrtc or set PAGEDLLM_NVRTC")


def compile_cubin(source: str, name: str, arch: str, defines: dict[str, int] | None = None) -> bytes:
    """A cubin of `source` for `arch` (e.g. "sm_90a"), with `defines` as -D options; RtcError with the log."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    src = source.encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, f"{name}.cu".encode(), 0, None, None) != _NVRTC_SUCCESS:
        raise RtcError(f"nvrtcCreateProgram failed for {name}")
    try:
        opts = [f"--gpu-architecture={arch}", "-default-device", "--std=c++17", "-lineinfo"]
        opts += [f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
        c_opts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = lib.nvrtcCompileProgram(prog, len(opts), c_opts)
        log_size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
        log = ctypes.create_string_buffer(log_size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if status != _NVRTC_SUCCESS:
            raise RtcError(f"NVRTC could not compile {name} for {arch} ({opts[4:]}):\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != _NVRTC_SUCCESS:
            raise RtcError(f"NVRTC produced no cubin for {name} ({arch} must be a real architecture, sm_XY)")
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def device_arch(device: Any) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


_KERNELS: dict[tuple[str, str, tuple[tuple[str, int], ...], str, int], Any] = {}


def load_kernel(source: str, name: str, device: Any, defines: dict[str, int] | None = None) -> Any:
    """`name` from `source` compiled for `device` and loaded there (cached per source, defines and device: a
    loaded function belongs to its device's context).

    Launch it with `launch` (NOTE 2)."""
    import torch
    from torch.cuda._utils import _cuda_load_module

    arch = device_arch(device)
    index = torch.device(device).index
    key = (source, name, tuple(sorted((defines or {}).items())), arch, torch.cuda.current_device() if index is None else index)
    kernel = _KERNELS.get(key)
    if kernel is None:
        cubin = compile_cubin(source, name, arch, defines)
        with torch.cuda.device(device):
            loaded = _cuda_load_module(cubin, [name])
        assert isinstance(loaded, dict), loaded
        kernel = loaded[name]
        _KERNELS[key] = kernel
    return kernel


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)),
                ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_SHARED_OPT_IN: dict[int, int] = {}  # CUfunction -> the dynamic shared memory it was allowed


def launch(kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any],
           pdl: bool = False, shared_mem: int = 0) -> None:
    """kernel(args) on the current stream; `pdl` launches it with programmatic stream serialization, so it may
    start before the kernel ahead of it ends (it must execute griddepcontrol.wait before reading that
    kernel's output: core/layers/pdl.py). Tensors pass as device pointers, ints as C ints. `shared_mem`: bytes
    of dynamic shared memory (above 48 KiB the function is opted in once, as the driver requires)."""
    import torch
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    keep: list[Any] = []
    for a in args:
        keep.append(ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a))
    c_args = (ctypes.c_void_p * len(keep))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in keep])
    stream = torch.cuda.current_stream()
    lib = _get_gpu_runtime_library()
    if shared_mem > 48 * 1024 and _SHARED_OPT_IN.get(kernel.func.value or 0, 0) < shared_mem:
        _check_cuda(lib.cuFuncSetAttribute(kernel.func, _MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(shared_mem)))
        _SHARED_OPT_IN[kernel.func.value or 0] = shared_mem
    if not pdl:
        _check_cuda(lib.cuLaunchKernel(kernel.func, *grid, *block, shared_mem, stream._as_parameter_, c_args, None))
        return
    attr = _Attr()
    attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.flag = 1
    config = _LaunchConfig(*grid, *block, shared_mem, ctypes.c_void_p(stream.cuda_stream), ctypes.pointer(attr), 1)
    _check_cuda(lib.cuLaunchKernelEx(ctypes.byref(config), kernel.func, c_args, None))
