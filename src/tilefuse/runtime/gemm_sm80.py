"""Compile and launch the generated sm_80 GEMM (mma.sync + cp.async) on torch tensors.

    g = compile_gemm_sm80(GemmProblem(m, n, k, "bf16", b_major="K"))
    out = g(a, b)                          # a [M, K], b [N, K] (or [K, N]); returns the epilogue's output
    g(a, b, out=out, bias=bias)            # preallocated outputs and epilogue operands by name

Same problem type, call convention and checks as `runtime.gemm.GemmKernel` (the sm_90a
kernel); what differs is that A and B are passed as plain pointers (no tensor maps) and
need only the alignment of one cp.async copy (2 to 16 bytes, from the row length).
The cubin is built for the arch it will run on: sm_80 or any later one (mma.sync runs on
Hopper too), by default the current device's.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .. import dtypes
from ..codegen import gemm_sm80
from ..codegen.gemm_sm90 import GemmError, GemmProblem
from . import cache, nvrtc
from .gemm import GemmKernel
from .launch import _drv, _raw_stream, load_function


@dataclass
class Sm80GemmKernel(GemmKernel):
    """A compiled sm_80 GEMM; `source` is a gemm_sm80.Sm80Source."""

    pdl = False  # launched plainly: its kernel does not wait for the one before

    def _check_alignment(self, where: str, name: str, t):
        align = {"a": self.source.align_a, "b": self.source.align_b}.get(name, 1)
        if self.source.pair_store and name in {o.name for o in self.problem.out_epilogue.outputs}:
            align = 4  # two adjacent 16-bit outputs in one 4-byte store
        if t.data_ptr() % align:
            raise ValueError(f"{where}: this kernel copies it {align} bytes at a time and needs it {align}-byte "
                             f"aligned; it starts {t.data_ptr() % align} bytes past a boundary (use .clone())")

    def _load(self, device: int):
        module, func, _ = load_function(self.cubin.data, self.source.name, device, self.source.smem_bytes)
        self._loaded[device] = (module, func)
        return self._loaded[device]

    def __call__(self, a, b, *, prepacked=(), **tensors):
        """Run; outputs not passed are allocated. Returns the output, or a dict of outputs.
        (`prepacked` as the sm_90a kernel takes it: this template reads no table packed.)"""
        sa, sb = self.operand_shapes()
        self._check("a", a, sa, self.problem.dtype)
        self._check("b", b, sb, self.problem.dtype)
        ep = self.problem.out_epilogue
        outs = {}
        for buf in ep.outputs:
            if buf.name not in tensors:
                import torch

                tensors[buf.name] = torch.empty(buf.shape, dtype=dtypes.to_torch(buf.dtype), device=a.device)
            outs[buf.name] = tensors[buf.name]
        unknown = set(tensors) - set(self.source.params)
        if unknown:
            raise ValueError(f"GEMM {self.source.name}: unknown tensors {sorted(unknown)}; "
                             f"it takes {', '.join(self.source.params)}")
        if b.device != a.device:
            raise ValueError(f"GEMM {self.source.name}: all tensors must be on {a.device}")
        ptrs = [a.data_ptr(), b.data_ptr()]
        for name in self.source.params:
            if name not in tensors:
                raise ValueError(f"GEMM {self.source.name}: missing epilogue operand {name!r}")
            buf = ep.buffer(name)
            self._check(name, tensors[name], buf.shape, buf.dtype)
            if tensors[name].device != a.device:
                raise ValueError(f"GEMM {self.source.name}: all tensors must be on {a.device}")
            ptrs.append(tensors[name].data_ptr())
        self.launch_ptrs(a.get_device(), ptrs)
        return next(iter(outs.values())) if len(outs) == 1 else outs

    def launch_ptrs(self, device: int, ptrs) -> None:
        """Launch on raw pointers (A, B, then `source.params`), checked by the caller."""
        from cuda.bindings import driver

        _, func = self._loaded.get(device) or self._load(device)
        vals = [ctypes.c_void_p(p) for p in ptrs]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(x) for x in vals])
        stream = driver.CUstream(_raw_stream(device))
        err = driver.cuLaunchKernel(func, *self.source.grid, *self.source.block, self.source.smem_bytes, stream,
                                    ctypes.addressof(params), 0)
        if err[0] != driver.CUresult.CUDA_SUCCESS:
            _drv(err, f"launch of {self.source.name}")


def _arch(arch: str | None) -> str:
    arch = nvrtc.normalize_arch(arch) if arch else nvrtc.current_arch()
    major = nvrtc.arch_number(arch) // 10
    if major < 8:
        raise GemmError(f"the mma.sync / cp.async GEMM needs sm_80 or later, not {arch}")
    return arch


def compile_gemm_sm80(problem: GemmProblem, schedule: gemm_sm80.Sm80Schedule | None = None,
                      arch: str | None = None) -> Sm80GemmKernel:
    """Render and compile (through the cubin cache) for `arch` (default: the current device's).
    A cubin runs only on the arch it was built for, so build for the GPU it will run on."""
    arch = _arch(arch)
    src = gemm_sm80.render(problem, schedule, arch)
    cubin, hit = cache.compile_cached(src.source, src.name, arch)
    return Sm80GemmKernel(src, cubin, hit)


def _precompile_one(item):
    problem, schedule, arch = item
    compile_gemm_sm80(problem, schedule, arch)
    return True


def precompile(items, workers: int | None = None) -> int:
    """Fill the cubin cache for many (problem, schedule, arch) triples in parallel processes
    (NVRTC is CPU-bound; a test or tuning session compiling dozens of GEMMs waits for the
    slowest process instead of the sum). Returns how many were compiled or found."""
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor

    items = list(items)
    workers = workers or min(len(items), os.cpu_count() or 1)
    if workers <= 1 or len(items) <= 1:
        return sum(_precompile_one(i) for i in items)
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        return sum(pool.map(_precompile_one, items))
