"""Compile a C source shipped with the package into a shared object on first use, once per machine.

    build_shared(source, flags) -> Path of the .so (raises RuntimeError with the compiler's message)
    compiler()                  -> the C compiler to use, or None
    load_native(source, flags, disable_env) -> (the loaded library, None) or (None, why not)

Used by the native CPU kernels (the gguf plugin's cpu_ops.c and gguf_cpu.c). The object goes to
``$PAGEDLLM_CACHE_DIR`` (default ``~/.cache/pagedllm``)/native under a name hashed from the source, the flags,
the compiler's version and this CPU's flags, so an edit, another compiler or another machine sharing the home
folder gets its own build. The build goes to a temporary name and is renamed into place, so processes
starting together (tensor-parallel ranks, test workers) never load a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm"
    )
    return Path(root) / "native"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build_shared(source: Path, flags: list[str], cc: str) -> Path:
    """The shared object of `source` built with `cc` and `flags` (cached; built now if missing)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\0".join([source.read_text(), " ".join(flags), version, _cpu_flags(), platform.machine()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder's identical file may win, either is fine
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_native(
    source: Path, flags: list[str], disable_env: str, fallback: str
) -> tuple[ctypes.CDLL | None, str | None]:
    """Build (or reuse) and load `source`; (None, the reason) when $disable_env turns it off, no compiler is
    found or the build or load fails -- the callers then run `fallback`, which a failed build logs."""
    setting = os.environ.get(disable_env, "1")
    if setting.lower() in ("0", "false", "off", "no"):
        return None, f"{disable_env}={setting}"
    cc = compiler()
    if cc is None:
        return None, "no C compiler found ($CC, cc, gcc, clang)"
    try:
        return ctypes.CDLL(str(build_shared(source, flags, cc))), None
    except (OSError, RuntimeError) as e:
        reason = f"building {source.name} failed: {e}"
        logging.getLogger("pagedllm").warning("%s unavailable (%s); using %s", source.name, reason, fallback)
        return None, reason
