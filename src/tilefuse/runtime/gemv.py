"""Compile and launch the GEMV template (codegen/gemv.py) on torch tensors.

    g = compile_gemv(GemmProblem(1, n, k, "bf16", b_major="K"))
    out = g(a, b)                          # a [M, K], b [N, K]; returns the epilogue's output

Same problem type, call convention and checks as the tile templates' kernels
(runtime.gemm.GemmKernel); A and B are plain pointers, 16-byte aligned. On sm_90 both forms
launch programmatically like every generated kernel (runtime.launch.pdl_enabled).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ..codegen import gemv
from ..codegen.gemm_sm90 import GemmError, GemmProblem
from . import cache, nvrtc
from .gemm_sm80 import Sm80GemmKernel
from .launch import _drv, _raw_stream, launch_attributes, load_function, pdl_enabled


@dataclass
class GemvKernel(Sm80GemmKernel):
    """A compiled GEMV; `source` is a gemv.GemvSource."""

    pdl = True  # both forms wait for the kernel before (tf_pdl_wait): they may launch programmatically

    def _load(self, device: int):
        from cuda.bindings import driver

        module, func, _ = load_function(self.cubin.data, self.source.name, device, 0)
        cfg = None
        attrs = launch_attributes(driver, (1, 1, 1), self.pdl and pdl_enabled(self.cubin.arch))
        if attrs:
            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.source.grid
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.source.block
            cfg.sharedMemBytes = 0
            cfg.attrs = attrs
            cfg.numAttrs = len(attrs)
        self._loaded[device] = (module, func, cfg)
        return self._loaded[device]

    def launch_ptrs(self, device: int, ptrs) -> None:
        """Launch on raw pointers (A, B, then `source.params`), checked by the caller."""
        from cuda.bindings import driver

        _, func, cfg = self._loaded.get(device) or self._load(device)
        key = tuple(ptrs)
        args = self._args.get(key)
        if args is None:
            vals = [ctypes.c_void_p(p) for p in ptrs]
            params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(x) for x in vals])
            if len(self._args) > 64:
                self._args.clear()
            args = self._args[key] = (ctypes.addressof(params), params, vals)
        handle = _raw_stream(device)
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = driver.CUstream(handle)
        if cfg is None:
            err = driver.cuLaunchKernel(func, *self.source.grid, *self.source.block, 0, stream, args[0], 0)
        else:
            cfg.hStream = stream
            err = driver.cuLaunchKernelEx(cfg, func, args[0], 0)
        if err[0] != driver.CUresult.CUDA_SUCCESS:
            _drv(err, f"launch of {self.source.name}")


def compile_gemv(problem: GemmProblem, schedule: gemv.GemvSchedule | None = None,
                 arch: str | None = None) -> GemvKernel:
    """Render and compile (through the cubin cache) for `arch` (default: the current device's)."""
    arch = nvrtc.normalize_arch(arch) if arch else nvrtc.current_arch()
    if nvrtc.arch_number(arch) < 80:
        raise GemmError(f"the GEMV template is built for sm_80 or later, not {arch}")
    src = gemv.render(problem, schedule, arch)
    cubin, hit = cache.compile_cached(src.source, src.name, arch)
    return GemvKernel(src, cubin, hit)
