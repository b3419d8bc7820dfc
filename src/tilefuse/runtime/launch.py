"""Compile a Loop IR kernel and launch it on torch tensors, on the current stream.

    ck = compile_kernel(kernel)            # render -> NVRTC (through the cubin cache)
    ck(x, w, out)                          # tensors in kernel.params order, outputs preallocated

Each call checks every tensor against its buffer (CUDA device, dtype, shape, contiguity)
and raises ValueError naming the buffer; the check is one comparison per tensor, and the
detailed message is built only when it fails. A buffer the kernel reads or writes with
16-byte vectors must be 16-byte aligned; a tensor that is not (a view at an odd offset) runs
a scalar variant of the kernel, compiled on first need, instead of failing.

A compiled program launches through `launch_ptrs` (raw pointers of tensors it allocated or
already checked): the launch arguments that never change are bound once per device, and the
pointers are written into a parameter array built once per kernel.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field, replace

from .. import dtypes
from .. import env
from ..codegen import mapreduce
from ..loop import ir
from . import cache, nvrtc


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the error."""


def _drv(result, what: str):
    from cuda.bindings import driver

    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        _, desc = driver.cuGetErrorString(err)
        dec = (lambda b: b.decode() if isinstance(b, bytes) else str(b))
        raise CudaError(f"{what} failed: {dec(name)} ({dec(desc)})")
    return result[1] if len(result) == 2 else (result[1:] if len(result) > 2 else None)


PDL_ENV = "TILEFUSE_PDL"
PDL_MIN_DRIVER = 12030  # CUDA 12.3: programmatic launches captured into CUDA graphs as programmatic edges


def pdl_enabled(arch: str, environ=None, driver_version: int | None = None) -> bool:
    """Whether a kernel built for `arch` launches with programmatic stream serialization: on
    sm_90 and later (where its tf_pdl_wait is an instruction; codegen/cexpr.py), with a driver
    of CUDA 12.3 or later (`driver_version` as cuDriverGetVersion gives it: queried once where
    None), unless TILEFUSE_PDL=0 (or false/off/no)."""
    if not env.switch(PDL_ENV, environ):
        return False
    if nvrtc.arch_number(arch) < 90:
        return False
    return (driver_version if driver_version is not None else _driver_version()) >= PDL_MIN_DRIVER


@functools.cache
def _driver_version() -> int:
    """The CUDA driver's version (12030 for 12.3); 0 where it cannot be asked."""
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        return version if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception:  # no driver library (a CPU machine)
        return 0


def launch_attributes(driver, cluster: tuple = (1, 1, 1), pdl: bool = False) -> list:
    """cuLaunchKernelEx's attributes: the cluster shape where there is one, and programmatic
    stream serialization where `pdl` (the kernel may begin while the one before it on the
    stream ends: its prologue, and its CTAs' placement, overlap that kernel's last wave)."""
    attrs = []
    if tuple(cluster) != (1, 1, 1):
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
        attrs.append(attr)
    if pdl:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    return attrs


def _build(kernel: ir.Kernel, arch: str, schedule, use_cache: bool = True):
    """(source, cubin, cache hit). Where values kept between passes (codegen/keep.py), or
    stores moved to an earlier pass, would spill, the kernel is built again without them; a
    default schedule whose kernel still spills registers is built again with fewer CTAs per SM
    budgeted for registers (min_blocks: half, but not below 4, above 4; one fewer from 4), down to one: ptxas, not
    an estimate, says what fits. (One fewer: Gemma 3's and Qwen3's q norm with its rotation
    spilled 4 bytes at 4, and fit at 3 where halving gave 2.) A schedule given (tuned, or asked
    for) is built as it is."""
    if kernel.family != "mapreduce":
        raise ValueError(f"kernel {kernel.name}: no code generator for the {kernel.family!r} family yet")
    sched = schedule or mapreduce.default_schedule(kernel, arch)
    while True:
        for keep_values in (True, False):
            src = mapreduce.render(kernel, sched, arch, keep_values)
            if use_cache:
                cubin, hit = cache.compile_cached(src.source, src.name, arch)
            else:
                cubin, hit = nvrtc.compile_cuda(src.source, src.name, arch), False
            if cubin.info.clean or not (src.kept or src.moved):
                break
        spills = cubin.info.spill_stores or cubin.info.spill_loads  # a stack frame alone (f32 sin's) is no spill
        if not spills or schedule is not None or sched.min_blocks <= 1:
            return src, cubin, hit
        sched = replace(sched, min_blocks=sched.min_blocks - 1 if sched.min_blocks <= 4 else max(4, sched.min_blocks // 2))


def compile_source_only(kernel: ir.Kernel, arch: str = "sm_90a", schedule=None,
                        use_cache: bool = True) -> tuple[mapreduce.KernelSource, nvrtc.Cubin]:
    """Render and compile to a cubin without touching a GPU (CPU tests, `--ir cuda`)."""
    src, cubin, _ = _build(kernel, nvrtc.normalize_arch(arch), schedule, use_cache)
    return src, cubin


@dataclass
class _Loaded:
    """A cubin loaded into one device's primary context, with its launch configuration."""

    module: object
    function: object
    config: object
    stream_handle: int
    context: object = None
    switch_context: bool = False  # several GPUs: make this device's context current per launch
    plain: bool = True            # no launch attribute (cluster, programmatic launch): cuLaunchKernel suffices
    stream: object = None
    prefix: tuple = ()            # cuLaunchKernel's leading arguments: function, grid, block, smem
    driver: object = None         # cuda.bindings.driver, bound once


@dataclass
class CompiledKernel:
    kernel: ir.Kernel
    arch: str
    source: mapreduce.KernelSource
    cubin: nvrtc.Cubin
    cache_hit: bool
    _loaded: dict = field(default_factory=dict, repr=False)   # device index -> _Loaded
    _scalar: "CompiledKernel | None" = field(default=None, repr=False)
    _workspaces: dict = field(default_factory=dict, repr=False)  # device index -> workspace (grid reductions)

    def __post_init__(self):
        n = len(self.source.params) + (1 if self.source.workspace_bytes else 0)
        self._vals = (ctypes.c_void_p * max(n, 1))()
        base = ctypes.addressof(self._vals)
        addrs = [base + i * ctypes.sizeof(ctypes.c_void_p) for i in range(n)]
        if self.source.rows is not None:  # the row count, then the rows' period (codegen.mapreduce.rows_free)
            self._rows = ctypes.c_int(self.source.rows)
            addrs.append(ctypes.addressof(self._rows))
            if self.source.period is not None:
                self._period = ctypes.c_int(self.source.period)
                addrs.append(ctypes.addressof(self._period))
        self._ptrs = (ctypes.c_void_p * max(len(addrs), 1))(*addrs)
        self._ptrs_addr = ctypes.addressof(self._ptrs)
        self._align = dict(self.source.alignment)
        self._align_idx = tuple((i, self._align[b.name]) for i, b in enumerate(self.kernel.params)
                                if b.name in self._align)

    @functools.cached_property
    def _expected(self) -> tuple:
        """(name, role, torch dtype, torch.Size) of each parameter, for the launch checks: made
        at the first launch, so that compiling (the tuner's compile-ahead processes) never
        imports torch."""
        import torch

        return tuple((b.name, "input" if b.role == "in" else "output", dtypes.to_torch(b.dtype),
                      torch.Size(b.shape)) for b in self.kernel.params)

    @property
    def info(self) -> nvrtc.CompileInfo:
        return self.cubin.info

    @property
    def schedule(self):
        return self.source.schedule

    # ---------------------------------------------------------------- checks

    def check(self, tensors) -> int:
        """Validate the arguments (dtype, shape, layout, then device); return the CUDA device index."""
        expected = self._expected
        if len(tensors) != len(expected):
            raise ValueError(f"kernel {self.kernel.name} takes {len(expected)} tensors "
                             f"({', '.join(e[0] for e in expected)}), got {len(tensors)}")
        device = None
        for t, (_, _, tdtype, shape) in zip(tensors, expected):
            if (getattr(t, "dtype", None) is not tdtype or t.shape != shape or not t.is_contiguous()
                    or not t.is_cuda):
                self._explain(tensors)
            d = t.get_device()
            if device is None:
                device = d
            elif d != device:
                self._explain(tensors)
        return device

    def _explain(self, tensors):
        """Raise the clearest error: wrong type, dtype, shape or layout first, then the device."""
        import torch

        expected = list(zip(self._expected, tensors))
        for (name, role, tdtype, shape), t in expected:
            where = f"kernel {self.kernel.name}: {role} {name!r}"
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype != tdtype:
                raise ValueError(f"{where}: expected dtype {tdtype}, got {t.dtype}")
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{where}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{where}: expected a contiguous (row-major) tensor, got strides "
                                 f"{tuple(t.stride())}; call .contiguous() first")
        first = None
        for (name, role, _, _), t in expected:
            where = f"kernel {self.kernel.name}: {role} {name!r}"
            if not t.is_cuda:
                raise ValueError(f"{where}: expected a CUDA tensor, got one on {t.device}")
            if first is None:
                first = t.device
            elif t.device != first:
                raise ValueError(f"{where}: expected it on {first} like the tensors before it, got {t.device}")
        raise AssertionError("unreachable: arguments passed every check")

    # ---------------------------------------------------------------- launch

    def _load(self, device: int) -> _Loaded:
        from cuda.bindings import driver

        module, func, ctx = load_function(self.cubin.data, self.source.name, device, self.source.smem_bytes)
        src = self.source
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = src.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = src.block
        cfg.sharedMemBytes = src.smem_bytes
        if src.cluster[0] > 8:
            _drv(driver.cuFuncSetAttribute(
                func, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                "cuFuncSetAttribute(non-portable cluster size)")
        attrs = launch_attributes(driver, src.cluster, pdl_enabled(self.arch))
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        import torch

        loaded = _Loaded(module, func, cfg, -1, ctx, torch.cuda.device_count() > 1, not attrs,
                         prefix=(func, *src.grid, *src.block, src.smem_bytes), driver=driver)
        self._loaded[device] = loaded
        return loaded

    def launch(self, tensors, device: int, ptrs=None):
        """Launch on `device`'s current torch stream; tensors already checked."""
        loaded = self._loaded.get(device) or self._load(device)
        driver = loaded.driver
        if loaded.switch_context:
            _drv(driver.cuCtxSetCurrent(loaded.context), "cuCtxSetCurrent")
        handle = _raw_stream(device)
        if handle != loaded.stream_handle:
            loaded.stream = driver.CUstream(handle)
            loaded.config.hStream = loaded.stream
            loaded.stream_handle = handle
        if ptrs is None:
            ptrs = [t.data_ptr() for t in tensors]
        if self.source.workspace_bytes and len(ptrs) == len(self.source.params):
            ptrs = list(ptrs) + [self.workspace(device).data_ptr()]
        self._vals[:len(ptrs)] = ptrs
        if loaded.plain:  # no launch attributes: the plain call converts fewer arguments
            err = driver.cuLaunchKernel(*loaded.prefix, loaded.stream, self._ptrs_addr, 0)
        else:
            err = driver.cuLaunchKernelEx(loaded.config, loaded.function, self._ptrs_addr, 0)
        if err[0] != driver.CUresult.CUDA_SUCCESS:
            _drv(err, f"launch of {self.source.name}")

    def launch_ptrs(self, device: int, ptrs) -> None:
        """Launch on raw pointers in parameter order, for a caller that allocated or checked the
        tensors itself (a compiled program): only the 16-byte alignment is checked here."""
        for i, a in self._align_idx:
            if ptrs[i] % a:
                return self.scalar_variant().launch(None, device, ptrs)
        self.launch(None, device, ptrs)

    def workspace(self, device: int):
        """This kernel's own workspace on `device`, for callers that pass none (a program's
        runner passes its own: see runtime/runner.py). Zeroed once; a grid reduction leaves
        its counters at zero after every launch. Launches of one kernel that share it must be
        ordered (one stream): two at once would count into the same counters."""
        ws = self._workspaces.get(device)
        if ws is None:
            import torch

            ws = self._workspaces[device] = new_workspace(self.source.workspace_bytes, torch.device("cuda", device))
        return ws

    def scalar_variant(self) -> "CompiledKernel":
        """The same kernel without vector accesses, for misaligned tensors (compiled on first need)."""
        if self._scalar is None:
            self._scalar = compile_kernel(self.kernel, self.arch, mapreduce.scalar_fallback(self.source.schedule))
        return self._scalar

    def __call__(self, *tensors, workspace=None):
        """Check and launch. `workspace`: the grid-reduction workspace to use instead of this
        kernel's own (`new_workspace`; a caller that keeps one per launch site, such as the
        tuner's benchmark worker, which gives each candidate a fresh one)."""
        device = self.check(tensors)
        ptrs = [t.data_ptr() for t in tensors]
        if workspace is not None and self.source.workspace_bytes:
            self._check_workspace(workspace, device)
            ptrs.append(workspace.data_ptr())
        self.launch_ptrs(device, ptrs)

    def _check_workspace(self, ws, device: int):
        import torch

        need = self.source.workspace_bytes
        if (not isinstance(ws, torch.Tensor) or ws.dtype != torch.uint8 or not ws.is_cuda
                or ws.get_device() != device or not ws.is_contiguous() or ws.numel() < need):
            got = (f"{ws.dtype} [{ws.numel()}] on {ws.device}" if isinstance(ws, torch.Tensor)
                   else type(ws).__name__)
            raise ValueError(f"kernel {self.kernel.name}: workspace: expected a contiguous torch.uint8 tensor of "
                             f"at least {need} bytes on cuda:{device}, got {got}")

    def allocate_outputs(self, device="cuda", poison: bool = True) -> dict:
        """Fresh output tensors by name; floats poisoned with NaN so unwritten elements show."""
        import torch

        outs = {}
        for b in self.kernel.outputs:
            t = torch.empty(b.shape, dtype=dtypes.to_torch(b.dtype), device=device)
            if poison:
                t.fill_(float("nan") if dtypes.is_float(b.dtype) else -12345 if b.dtype not in ("bool", "u8") else 0)
            outs[b.name] = t
        return outs


def workspace_bytes(compiled) -> int:
    """Bytes of grid-reduction workspace `compiled` takes after its parameters (0: none; also
    for kernels of other families and stand-ins without a rendered source)."""
    return getattr(getattr(compiled, "source", None), "workspace_bytes", 0) or 0


def new_workspace(nbytes: int, device):
    """A grid reduction's workspace (arrival counters, group partials, per-row values) as
    every launcher provides it: zeroed once, when made. The kernel resets each counter it
    counts into (the CTA that finds it full), and writes partials and per-row values before it
    reads them, so later launches on the same workspace, CUDA-graph replays included, need no
    memset: a launch costs the kernel alone. Launches sharing one must be ordered (one stream)."""
    import torch

    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def load_function(data: bytes, name: str, device: int, smem_bytes: int = 0):
    """(module, function, context) of kernel `name` from a cubin, loaded into `device`'s primary
    context (the one torch uses), allowed `smem_bytes` of dynamic shared memory."""
    from cuda.bindings import driver

    _drv(driver.cuInit(0), "cuInit")
    dev = _drv(driver.cuDeviceGet(device), "cuDeviceGet")
    ctx = _drv(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _drv(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    image = ctypes.create_string_buffer(data, len(data))
    try:
        loaded = driver.cuModuleLoadData(ctypes.addressof(image))
    except TypeError:  # bindings that want the bytes themselves
        loaded = driver.cuModuleLoadData(data)
    module = _drv(loaded, f"cuModuleLoadData({name})")
    func = _drv(driver.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
    # the 48 KB a launch may have without opting in counts the kernel's static shared memory
    # (its exchange arrays) too: 48 KB of staged rows beside them needs the opt-in
    static = 0
    if smem_bytes:
        static = _drv(driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func),
                      "cuFuncGetAttribute(static shared memory)")
    if smem_bytes and smem_bytes + static > 48 * 1024:
        _drv(driver.cuFuncSetAttribute(
            func, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem_bytes), "cuFuncSetAttribute(max dynamic shared memory)")
    return module, func, ctx


def _raw_stream(device: int) -> int:
    """The current torch stream's CUstream handle (the fast private call, else the public one)."""
    import torch

    try:
        return torch._C._cuda_getCurrentRawStream(device)
    except AttributeError:
        return torch.cuda.current_stream(device).cuda_stream


def compile_kernel(kernel: ir.Kernel, arch: str | None = None, schedule=None) -> CompiledKernel:
    """Render `kernel` (default schedule for `arch`, the current device's if None) and compile it."""
    arch = nvrtc.normalize_arch(arch) if arch else nvrtc.current_arch()
    src, cubin, hit = _build(kernel, arch, schedule)
    return CompiledKernel(kernel=kernel, arch=arch, source=src, cubin=cubin, cache_hit=hit)
