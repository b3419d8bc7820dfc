"""Compile and launch the generated sm_90a GEMM on torch tensors.

    g = compile_gemm(GemmProblem(m, n, k, "bf16", b_major="K"))
    out = g(a, b)                          # a [M, K], b [N, K] (or [K, N]); returns the epilogue's output
    g(a, b, out=out, bias=bias)            # preallocated outputs and epilogue operands by name

The tensor maps (TMA descriptors) are encoded on the host from the operands' pointers (and
the output's, where the kernel stores through TMA) and cached per pointer set, so a
steady-state call with the same tensors encodes nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
from dataclasses import dataclass, field

from .. import dtypes
from ..codegen import epilogue as epi, gemm_sm90
from ..codegen.gemm_sm90 import GemmError, GemmProblem, GemmSchedule
from . import cache, nvrtc
from .launch import _drv, _raw_stream, launch_attributes, load_function, pdl_enabled


def _sm_count(device: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def encode_tma(ptr: int, dtype: str, dims: tuple[int, ...], strides: tuple[int, ...],
               box: tuple[int, ...], swizzle: int) -> bytes:
    """A CUtensorMap (128 bytes) for a tiled TMA copy; dims and box innermost first,
    strides in bytes for dims 1.. ."""
    from cuda.bindings import driver as d

    dt = {"bf16": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
          "f16": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16}[dtype]
    sw = [d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE, d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
          d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B, d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B][swizzle]
    tmap = _drv(d.cuTensorMapEncodeTiled(
        dt, len(dims), ptr, [d.cuuint64_t(x) for x in dims], [d.cuuint64_t(x) for x in strides],
        [d.cuuint32_t(x) for x in box], [d.cuuint32_t(1)] * len(dims),
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    import struct

    return struct.pack("<16Q", *[int(x) for x in tmap.opaque])


@dataclass
class GemmKernel:
    source: gemm_sm90.GemmSource
    cubin: nvrtc.Cubin
    cache_hit: bool
    _loaded: dict = field(default_factory=dict, repr=False)
    _maps: dict = field(default_factory=dict, repr=False)
    _args: dict = field(default_factory=dict, repr=False)    # pointer set -> launch argument block
    _streams: dict = field(default_factory=dict, repr=False)
    _foreign: list = field(default_factory=list, repr=False)  # workspaces of captures tilefuse did not begin
    pdl = True  # its kernel waits for the one before (tf_pdl_wait): it may launch programmatically

    def __post_init__(self):
        # What every call checks against, built once: a call of a small GEMM is over in
        # ~20 us, so host time spent rebuilding the epilogue program would be the run time.
        ep = self.problem.out_epilogue
        self._ep = ep
        self._out_bufs = tuple(ep.outputs)
        self._param_bufs = tuple(ep.buffer(name) for name in self.source.params)
        self._param_names = frozenset(self.source.params)
        # (subclasses for other targets may have no TMA store: no c_box on their source)
        self._tma_out_names = (epi.tile_outputs(ep)[0].name,) if getattr(self.source, "c_box", None) is not None else ()
        self._tma_load_names = tuple(getattr(self.source, "tma_loads", ()))  # operands TMA reads in (64 x 64) boxes
        self._split = getattr(self.source, "workspace", 0) > 0  # split-K: workspace and counters per stream
        self._m_arg = getattr(self.source, "m_arg", False)  # M passed last (one cubin for many M)
        self._packed = tuple(getattr(self.source, "packed_tables", ()))
        # where the tensor maps' pointers sit in a launch's pointer list (a, b, then source.params)
        params = list(self.source.params)
        self._map_at = tuple(2 + params.index(n) for n in self._tma_out_names + self._tma_load_names)

    @property
    def problem(self) -> GemmProblem:
        return self.source.problem

    @property
    def schedule(self) -> GemmSchedule:
        return self.source.schedule

    @property
    def info(self) -> nvrtc.CompileInfo:
        return self.cubin.info

    def operand_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        p = self.problem
        lead = (p.batch,) if p.batch > 1 else ()
        b = (p.n, p.k) if p.b_major == "K" else (p.k, p.n)
        return lead + (p.m, p.k), lead + b

    def _check(self, name: str, t, shape, dtype: str):
        import torch

        where = f"GEMM {self.source.name}: {name!r}"
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtypes.to_torch(dtype):
            raise ValueError(f"{where}: expected dtype {dtypes.to_torch(dtype)}, got {t.dtype}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{where}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{where}: expected a contiguous tensor, got strides {tuple(t.stride())}")
        if not t.is_cuda:
            raise ValueError(f"{where}: expected a CUDA tensor, got one on {t.device}")
        self._check_alignment(where, name, t)

    def _check_alignment(self, where: str, name: str, t):
        if (name in ("a", "b") or name in self._tma_outputs or name in self._tma_load_names) and t.data_ptr() % 16:
            raise ValueError(f"{where}: TMA needs 16-byte aligned operands; this one starts at "
                             f"{t.data_ptr() % 16} bytes past a boundary (use .clone())")
        if name in getattr(self.source, "pair_loads", ()) and t.data_ptr() % 4:
            raise ValueError(f"{where}: the epilogue reads this operand in 4-byte column pairs; it starts "
                             f"{t.data_ptr() % 4} bytes past a 4-byte boundary (use .clone())")

    @property
    def _tma_outputs(self) -> tuple[str, ...]:
        """Outputs the kernel writes through a TMA tensor map (they need 16-byte alignment)."""
        return self._tma_out_names

    def _tensor_maps(self, a: int, b: int, out: int | None = None, loads: tuple = ()) -> tuple[bytes, ...]:
        """The tensor maps for these pointers (A, B, the TMA-stored output, TMA-loaded operands)."""
        key = (a, b, out) + tuple(loads)
        hit = self._maps.get(key)
        if hit is not None:
            return hit
        p, src = self.problem, self.source
        e = 2
        amap = encode_tma(a, p.dtype, (p.k, p.m, p.batch), (p.k * e, p.m * p.k * e),
                          (src.a_box[0], src.a_box[1], 1), int(src.swizzle))
        if p.b_major == "K":
            bdims, bstr = (p.k, p.n, p.batch), (p.k * e, p.n * p.k * e)
        else:
            bdims, bstr = (p.n, p.k, p.batch), (p.n * e, p.k * p.n * e)
        bmap = encode_tma(b, p.dtype, bdims, bstr, (src.b_box[0], src.b_box[1], 1), int(src.swizzle))
        maps = (amap, bmap)
        if src.c_box is not None:
            # the output tile: [batch, M, N] of the epilogue's one 16-bit output, stored in
            # (64 x 64) boxes from 128-byte swizzled slots; TMA clips rows/columns past the end.
            # A residual loaded by TMA (shaped as the output) comes into the slots the same way.
            buf = self._out_bufs[0]
            n_out = buf.shape[-1]
            for t, dt in [(out, buf.dtype)] + [(x, self._ep.buffer(nm).dtype) for x, nm in zip(loads, self._tma_load_names)]:
                oe = dtypes.itemsize(dt)
                maps += (encode_tma(t, dt, (n_out, p.m, p.batch), (n_out * oe, p.m * n_out * oe),
                                    (src.c_box[0], src.c_box[1], 1), int(gemm_sm90.STORE_SWIZZLE)),)
        if len(self._maps) > 64:
            self._maps.clear()
        self._maps[key] = maps
        return maps

    def _load(self, device: int):
        from cuda.bindings import driver

        module, func, _ = load_function(self.cubin.data, self.source.name, device, self.source.smem_bytes)
        cl = self.source.cluster
        if self.source.exact_grid:  # stream-K cut its shares for exactly this many CTAs
            grid = self.source.grid_tiles * cl
        else:
            grid = min(self.source.grid_tiles, _sm_count(device) // cl) * cl
        cfg = None
        attrs = launch_attributes(driver, (cl, 1, 1), self.pdl and pdl_enabled(self.cubin.arch))
        if attrs:
            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.source.block
            cfg.sharedMemBytes = self.source.smem_bytes
            cfg.attrs = attrs
            cfg.numAttrs = len(attrs)
        self._loaded[device] = (module, func, grid, cfg)
        return self._loaded[device]

    def _workspace(self, device: int, stream: int):
        """Split-K's or stream-K's (partials, flags) for a launch on `stream`: the arena of the
        CUDA graph tilefuse is capturing, else the stream's own (`Workspace`). Inside a capture
        someone else began (a caller's `torch.cuda.graph` around a program), a fresh pair that
        this kernel keeps: its counters' zeroing is recorded into that graph alone, and no
        other graph, which might replay first, relies on it."""
        arena = _CAPTURING.get()
        if arena is None:
            import torch

            if torch.cuda.is_current_stream_capturing():
                own = Workspace()
                self._foreign.append(own)  # (the caller's graph reads it for as long as it lives)
                return own.get(device, self.source.workspace, self.source.flags)
            arena = _STREAMS.get((device, stream))
            if arena is None:
                arena = _STREAMS[(device, stream)] = Workspace()
        return arena.get(device, self.source.workspace, self.source.flags)

    def allocate_outputs(self, device="cuda", poison: bool = True) -> dict:
        import torch

        outs = {}
        for buf in self._out_bufs:
            t = torch.empty(buf.shape, dtype=dtypes.to_torch(buf.dtype), device=device)
            if poison:
                t.fill_(float("nan"))
            outs[buf.name] = t
        return outs

    def __call__(self, a, b, *, prepacked=(), **tensors):
        """Run; outputs not passed are allocated. Returns the output, or a dict of outputs.
        Tables the kernel reads column-permuted (source.packed_tables) are given as the
        epilogue indexes them and permuted here on every call, except those named in
        `prepacked`, given already through gemm_sm90.pack_table."""
        sa, sb = self.operand_shapes()
        self._check("a", a, sa, self.problem.dtype)
        self._check("b", b, sb, self.problem.dtype)
        outs = {}
        for buf in self._out_bufs:
            if buf.name not in tensors:
                import torch

                tensors[buf.name] = torch.empty(buf.shape, dtype=dtypes.to_torch(buf.dtype), device=a.device)
            outs[buf.name] = tensors[buf.name]
        if len(tensors) != len(self._param_names) or not self._param_names.issuperset(tensors):
            unknown = set(tensors) - self._param_names
            if unknown:
                raise ValueError(f"GEMM {self.source.name}: unknown tensors {sorted(unknown)}; "
                                 f"it takes {', '.join(self.source.params)}")
        for name, w in self._packed:
            t = tensors.get(name)
            if t is not None and name not in prepacked:
                self._check(name, t, self._ep.buffer(name).shape, self._ep.buffer(name).dtype)
                tensors[name] = gemm_sm90.pack_table(t, w)
        ptrs = [a.data_ptr(), b.data_ptr()]
        for buf in self._param_bufs:
            name = buf.name
            if name not in tensors:
                raise ValueError(f"GEMM {self.source.name}: missing epilogue operand {name!r}")
            self._check(name, tensors[name], buf.shape, buf.dtype)
            if tensors[name].device != a.device or b.device != a.device:
                raise ValueError(f"GEMM {self.source.name}: all tensors must be on {a.device}")
            ptrs.append(tensors[name].data_ptr())
        self.launch_ptrs(a.get_device(), ptrs)
        return next(iter(outs.values())) if len(outs) == 1 else outs

    def launch_ptrs(self, device: int, ptrs) -> None:
        """Launch on `device`'s current stream on raw pointers: A, B, then the epilogue's
        parameters in `source.params` order; for a caller that allocated or checked the tensors
        itself (a compiled program's runner): nothing is checked here."""
        from cuda.bindings import driver

        module, func, grid, cfg = self._loaded.get(device) or self._load(device)
        handle = _raw_stream(device)
        ws = self._workspace(device, handle) if self._split else None
        # (both addresses: a dropped capture's arena frees its buffers, and a later one may get
        # the partials' address back with its counters elsewhere)
        key = (tuple(ptrs), ws[0].data_ptr(), ws[1].data_ptr()) if ws is not None else tuple(ptrs)
        args = self._args.get(key)
        if args is None:  # encode the tensor maps and build the argument block once per pointer set
            at = self._map_at
            tma_out = ptrs[at[0]] if self._tma_out_names else None
            maps = self._tensor_maps(ptrs[0], ptrs[1], tma_out, tuple(ptrs[i] for i in at[len(self._tma_out_names):]))
            bufs = [ctypes.create_string_buffer(m, 128) for m in maps]
            vals = [ctypes.c_void_p(p) for p in ptrs[2:]]
            if self._split:
                vals = [ctypes.c_void_p(t.data_ptr()) for t in ws] + vals
            if self._m_arg:
                vals.append(ctypes.c_int(self.problem.m))
            addrs = [ctypes.addressof(x) for x in bufs + vals]
            params = (ctypes.c_void_p * len(addrs))(*addrs)
            if len(self._args) > 64:
                self._args.clear()
            args = self._args[key] = (ctypes.addressof(params), params, bufs, vals)
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = driver.CUstream(handle)
        if cfg is None:
            err = driver.cuLaunchKernel(func, grid, 1, 1, *self.source.block, self.source.smem_bytes, stream,
                                        args[0], 0)
        else:
            cfg.hStream = stream
            err = driver.cuLaunchKernelEx(cfg, func, args[0], 0)
        if err[0] != driver.CUresult.CUDA_SUCCESS:
            _drv(err, f"launch of {self.source.name}")


class Workspace:
    """Split-K's and stream-K's scratch, f32 partial sums and int32 turn counters, shared by GEMM
    launches that never run at once: those on one stream, or those of one CUDA graph (which
    runs its launches in order). A launch writes every partial it reads and leaves the counters
    at zero, so one buffer of each serves every GEMM, grown to the largest asked. Each kernel had
    its own per stream before, and each graph capture is made on a new stream: an 8-layer,
    4096-wide Llama's decode steps held 2.8 GiB of them (bench/LOG_blocks.md, session 38). A
    smaller buffer handed out before is kept: launch argument blocks and captured graphs hold
    its address. Each grows on its own, at least doubling (so the buffers of one kind sum to
    under four times the largest request; a capture reserves its largest first: exactly that)."""

    def __init__(self):
        self.partials: dict = {}  # device -> [f32 tensors], the last the largest
        self.flags: dict = {}     # device -> [int32 tensors, zeroed], the last the largest

    def get(self, device: int, floats: int, flags: int):
        return (_at_least(self.partials, device, floats, zeroed=False),
                _at_least(self.flags, device, flags, zeroed=True))

    def reserve(self, device: int, floats: int, flags: int) -> None:
        """Allocate for the largest of what will be asked now, in one buffer of each kind."""
        if floats or flags:
            self.get(device, floats, flags)

    def nbytes(self) -> int:
        return sum(t.numel() * 4 for bufs in (*self.partials.values(), *self.flags.values()) for t in bufs)


def _at_least(bufs: dict, device: int, n: int, zeroed: bool):
    have = bufs.setdefault(device, [])
    if have and have[-1].numel() >= n:
        return have[-1]
    have.append(_alloc(max(n, 2 * have[-1].numel() if have else 0, 1), device, zeroed))
    return have[-1]


def _alloc(n: int, device: int, zeroed: bool):
    """n int32 zeros (the counters) or n float32 (the partials) on the GPU `device`."""
    import torch

    if zeroed:
        return torch.zeros(n, dtype=torch.int32, device=f"cuda:{device}")
    return torch.empty(n, dtype=torch.float32, device=f"cuda:{device}")


_STREAMS: dict = {}  # (device, raw stream) -> Workspace, for launches outside a capture
_CAPTURING = contextvars.ContextVar("tilefuse_gemm_workspace", default=None)


@contextlib.contextmanager
def capturing(arena: Workspace):
    """GEMMs launched inside take their workspace from `arena` (a CUDA graph's, which must keep
    it alive as long as it may replay), not from their stream's."""
    token = _CAPTURING.set(arena)
    try:
        yield arena
    finally:
        _CAPTURING.reset(token)


def compile_gemm(problem: GemmProblem, schedule: GemmSchedule | None = None, arch: str = "sm_90a") -> GemmKernel:
    arch = nvrtc.normalize_arch(arch)
    if arch != "sm_90a":
        raise GemmError(f"the TMA/wgmma GEMM needs sm_90a, not {arch}")
    src = gemm_sm90.render(problem, schedule)
    cubin, hit = cache.compile_cached(src.source, src.name, arch)
    return GemmKernel(src, cubin, hit)
