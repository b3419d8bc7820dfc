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
from .. import dtypes
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
    return _built(lambda a: gemv.render(problem, schedule, a), GemvKernel, arch)


def _built(render, kind, arch: str | None):
    """kind(render(arch)'s source, its cubin, whether the cache had it), for sm_80 and later."""
    arch = nvrtc.normalize_arch(arch) if arch else nvrtc.current_arch()
    if nvrtc.arch_number(arch) < 80:
        raise GemmError(f"the GEMV template is built for sm_80 or later, not {arch}")
    src = render(arch)
    cubin, hit = cache.compile_cached(src.source, src.name, arch)
    return kind(src, cubin, hit)


@dataclass
class GemvGroupKernel(GemvKernel):
    """GEMMs of one A in one launch (gemv.render_group)."""

    def __post_init__(self):
        # not GemmKernel's: its per-call tables describe one epilogue, and a group's call
        # checks each member against its own (_member); none of its TMA or split-K state applies
        self._ep, self._out_bufs, self._param_bufs = None, (), ()
        self._param_names = frozenset(self.source.params)
        self._tma_out_names = self._tma_load_names = self._packed = self._map_at = ()
        self._split = self._m_arg = False

    def __call__(self, a, bs, tensors=None):
        """Run each member on `a` and its B (`bs`, in the group's order) with its epilogue's
        tensors (`tensors`: one dict a member, by the member's own names; outputs not passed
        are allocated). Returns each member's output, or dict of outputs, in order."""
        members = self.source.members
        tensors = [dict(t) for t in (tensors or [{}] * len(members))]
        if len(bs) != len(members) or len(tensors) != len(members):
            raise ValueError(f"GEMV group {self.source.name}: {len(members)} members, got {len(bs)} B tensor(s) "
                             f"and {len(tensors)} tensor dict(s)")
        ptrs, results = [a.data_ptr()], []
        for i, ((problem, names), b, own) in enumerate(zip(members, bs, tensors)):
            try:
                results.append(self._member(problem, names, a, b, own, ptrs, first=i == 0))
            except ValueError as e:
                raise ValueError(f"{e} (member {i}: {problem.m}x{problem.n}x{problem.k})") from None
        self.launch_ptrs(a.get_device(), ptrs)
        return results

    def _member(self, problem, names, a, b, own, ptrs, first):
        """Check one member's tensors, allocate its missing outputs, append its pointers (B,
        then its own parameters); its output, or dict of outputs."""
        import torch

        if first:
            self._check("a", a, (problem.m, problem.k), problem.dtype)  # (one A: the members agree on it)
        self._check("b", b, (problem.n, problem.k), problem.dtype)
        ep = problem.out_epilogue
        unknown = set(own) - set(names)
        if unknown:
            raise ValueError(f"GEMV group {self.source.name}: unknown tensors {sorted(unknown)}; "
                             f"it takes {', '.join(names)}")
        outs = {}
        for buf in ep.outputs:
            if buf.name not in own:
                own[buf.name] = torch.empty(buf.shape, dtype=dtypes.to_torch(buf.dtype), device=a.device)
            outs[buf.name] = own[buf.name]
        for t in [b, *own.values()]:
            if t.device != a.device:
                raise ValueError(f"GEMV group {self.source.name}: all tensors must be on {a.device}")
        ptrs.append(b.data_ptr())
        for name in names:
            if name not in own:
                raise ValueError(f"GEMV group {self.source.name}: missing epilogue operand {name!r}")
            buf = ep.buffer(name)
            self._check(name, own[name], buf.shape, buf.dtype)
            ptrs.append(own[name].data_ptr())
        return next(iter(outs.values())) if len(outs) == 1 else outs


def compile_gemv_group(problems, schedule=None, arch: str | None = None) -> GemvGroupKernel:
    """Render several GEMMs of one A as one launch (gemv.render_group) and compile it through the
    cubin cache for `arch` (default: the current device's)."""
    return _built(lambda a: gemv.render_group(problems, schedule, a), GemvGroupKernel, arch)

