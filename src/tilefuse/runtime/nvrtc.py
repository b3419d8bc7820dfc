"""CUDA C++ -> cubin through NVRTC (cuda.bindings), with ptxas's resource report.

Needs no GPU and no CUDA toolkit: the `nvidia-cuda-nvrtc` wheel carries the compiler, and
generated sources include no headers (see codegen.cexpr.PRELUDE). Sources that do include
toolkit headers can pass `include_dirs` (`cuda_include_dir()` finds a toolkit's).
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_OPTIONS = ("-std=c++17", "-default-device", "--ptxas-options=-v")


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; carries the kernel's name and NVRTC's full log."""

    def __init__(self, kernel: str, arch: str, log: str):
        self.kernel, self.arch, self.log = kernel, arch, log
        super().__init__(f"NVRTC failed to compile kernel {kernel!r} for {arch}:\n{log}")


@dataclass(frozen=True)
class CompileInfo:
    """ptxas's report for one entry point."""

    registers: int
    spill_stores: int   # bytes
    spill_loads: int    # bytes
    smem_bytes: int     # static shared memory
    stack_bytes: int = 0

    @property
    def clean(self) -> bool:
        """No spills and no stack frame: every register array stayed in registers."""
        return self.spill_stores == 0 and self.spill_loads == 0 and self.stack_bytes == 0


@dataclass(frozen=True)
class Cubin:
    data: bytes
    arch: str
    info: CompileInfo
    log: str


def _check(result, what: str):
    err = result[0]
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise RuntimeError(f"{what}: {msg.decode() if isinstance(msg, bytes) else msg}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    return tuple(_check(nvrtc.nvrtcVersion(), "nvrtcVersion"))


def normalize_arch(arch: str) -> str:
    """'sm_90a', '90a', 'sm_80', (9, 0) -> 'sm_90a' / 'sm_80'. Hopper (sm_90) always gets sm_90a."""
    if isinstance(arch, tuple):
        arch = f"sm_{arch[0]}{arch[1]}"
    given = arch = str(arch)
    if not arch.startswith(("sm_", "compute_")):
        arch = "sm_" + arch
    m = re.fullmatch(r"sm_(\d+)(a?)", arch)
    if not m:
        raise ValueError(f"unknown GPU architecture {given!r} (expected e.g. sm_90a or sm_80)")
    if int(m.group(1)) < 75 or len(m.group(1)) > 3:
        # (CUDA 13's NVRTC builds sm_75 and newer; a made-up sm_42 is not one)
        raise ValueError(f"GPU architecture {given!r} is not one tilefuse builds for: sm_75 (Turing) and newer, "
                         f"e.g. sm_80, sm_89, sm_90a")
    known = supported_archs()
    if known and int(m.group(1)) not in known:
        raise ValueError(f"GPU architecture {given!r} is not one this NVRTC builds for: "
                         + ", ".join(f"sm_{a}" for a in known))
    return "sm_90a" if m.group(1) == "90" else arch


def arch_number(arch: str) -> int:
    """'sm_90a' -> 90, 'sm_80' -> 80, 'sm_100a' -> 100 (0 where it names no number)."""
    digits = "".join(ch for ch in str(arch).split("_")[-1] if ch.isdigit())
    return int(digits) if digits else 0


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    """The architectures this NVRTC builds for (75, 80, ..., 121 with CUDA 13), or () where it
    cannot be asked (no cuda-python)."""
    try:
        from cuda.bindings import nvrtc

        err, archs = nvrtc.nvrtcGetSupportedArchs()
        return tuple(int(a) for a in archs) if int(err) == 0 else ()
    except Exception:  # (no cuda-python, no NVRTC library)
        return ()


def current_arch() -> str:
    """The architecture of torch's current CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: pass arch= explicitly (e.g. 'sm_90a') to compile without one")
    return normalize_arch(torch.cuda.get_device_capability())


def cuda_include_dir() -> str | None:
    """A CUDA toolkit include directory with cuda_bf16.h, if one is installed."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_bf16.h").exists():
            return str(Path(c) / "include")
    return None


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_info(log: str, entry: str) -> CompileInfo:
    """The resource lines ptxas -v printed for `entry` (the last function if entry is absent)."""
    sections = re.split(r"ptxas info\s*: Compiling entry function '([^']+)'", log)
    text = log
    if len(sections) > 1:
        pairs = dict(zip(sections[1::2], sections[2::2]))
        text = pairs.get(entry, sections[-1])
    regs = _PTXAS_REGS.search(text)
    spill = _PTXAS_SPILL.search(text)
    smem = _PTXAS_SMEM.search(text)
    return CompileInfo(
        registers=int(regs.group(1)) if regs else -1,
        spill_stores=int(spill.group(2)) if spill else 0,
        spill_loads=int(spill.group(3)) if spill else 0,
        smem_bytes=int(smem.group(1)) if smem else 0,
        stack_bytes=int(spill.group(1)) if spill else 0,
    )


def options_for(arch: str, extra: tuple[str, ...] = (), include_dirs: tuple[str, ...] = ()) -> tuple[str, ...]:
    arch = normalize_arch(arch)
    return (f"--gpu-architecture={arch}",) + DEFAULT_OPTIONS + tuple(f"-I{d}" for d in include_dirs) + tuple(extra)


def compile_cuda(source: str, name: str, arch: str, options: tuple[str, ...] | None = None) -> Cubin:
    """Compile `source` (entry point `name`) to a cubin for `arch`; raise CompileError with the log."""
    from cuda.bindings import nvrtc

    arch = normalize_arch(arch)
    opts = options if options is not None else options_for(arch)
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []),
                  "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.rstrip(b"\x00").decode(errors="replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(name, arch, log)
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        data = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, data), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return Cubin(data=bytes(data), arch=arch, info=parse_ptxas_info(log, name), log=log)
