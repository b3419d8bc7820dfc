"""A compiled program: the plan's steps run in order on torch tensors.

On CUDA tensors each map-reduce kernel runs as a generated CUDA kernel; on CPU tensors it
runs through the Loop IR interpreter (so everything but the kernels' speed is real without
a GPU). Externs run in PyTorch; aliases are free reshapes of contiguous memory.

A call costs little host time. Its tensors' (dtype, shape, device) tuple is the key to a
`Runner` built for that device on first sight (runner.py: weights, constants and kernel
parameters prepared once); only an unseen key gets the detailed check and its clear error.
On CUDA the runner sits behind CUDA-graph slots (graphs.py): after one warm-up call the
program is captured and replayed, and a result the caller still holds is never overwritten.
"""
from __future__ import annotations

import os
import threading
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .. import dtypes
from .. import env
from ..graph import ir
from ..codegen.gemv import takes as gemv_takes
from ..graph.fusion import Plan
from ..loop.lower import Lowered
from . import graphs as cuda_graphs
from .runner import Runner, check_inputs, signature

PREPARE_THREADS = 8  # kernels Program.prepare compiles at once

# Kernels compiled in this process, shared by every program that holds one. The programs one
# graph compiles to at different sizes (under torch.compile, `generate`'s cache grows a token a
# step) repeat most of their kernels, and rendering each again and hashing it for the cubin and
# tuning caches cost ~0.8 s a size for a 4-layer model on an H100. The key is the kernel under
# names made from what it computes (Loop IR: two layers' equal kernels are one) or the GEMM
# problem and its epilogue, the target, whether tuned knobs are looked up, and the tuning
# cache's state; an entry lives while some program holds its kernel.
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _shared(key, build):
    from ..tune.cache import state

    key = key + (state(),)
    got = _SHARED.get(key)
    if got is None:
        got = build()
        try:
            _SHARED[key] = got
        except TypeError:  # not weakly referable (a test's stand-in): not shared
            pass
    return got


def _aligned(t):
    """A weight on a GPU at a 16-byte boundary: a contiguous view at an odd offset (a slice of a
    larger tensor) is copied here, once, where the GEMM would otherwise copy it on every call,
    right before reading it (and a GEMM reads its weight B before waiting for the kernel before
    it: codegen/gemm_sm90.prefetch_b), and a map-reduce kernel would take its scalar variant."""
    if isinstance(t, torch.Tensor) and t.is_cuda and t.data_ptr() % 16:
        return t.clone()
    return t


@dataclass
class Program:
    graph: ir.Graph
    plan: Plan
    kernels: dict[str, Lowered]  # step name -> lowered kernel
    out_spec: object = None
    arch: str | None = None
    poison: bool = False  # fill outputs with NaN (or -1) before each kernel: unwritten elements show
    # CUDA-graph replay. None (auto): programs of two or more launches, unless
    # TILEFUSE_CUDA_GRAPHS=0; True: every program that can be captured, one launch or more; False: never
    graphs: bool | None = None
    graph_slots: int = 2  # captures per input signature (results the caller may hold at once, plus one)
    graph_clone: bool = False  # return clones of the graph's outputs instead of tracking what the caller holds
    schedules: object = None  # (kernel, arch, device) -> schedule or None (tune.lookup.tuned_schedule); None: defaults
    gemms: dict = None  # step name -> loop.lower_gemm.LoweredGemm
    # () -> "" or what changed in the weights since compiling (compiler.WeightGuard); with
    # `rebuild(args) -> Program`, a changed weight compiles the program again at the next call
    guard: object = None
    rebuild: object = None
    # the example inputs' nesting, tensors as TENSOR (`skeleton`): a call's containers are matched
    # against it, dicts by key; None: inputs flattened in pytree order
    inputs: object = None
    # runtime.shared_weights.WeightPool shared with the programs compiled from the same graph for
    # other sizes: one device copy of each weight for all of them; None: this program's own copies
    pool: object = None

    def __post_init__(self):
        self._compiled: dict = {}
        self._weights: dict = {}
        self._runners: dict = {}   # (device, poison) -> Runner
        self._entries: dict = {}   # (signature, poison, graphs) -> callable(tensors) -> flat outputs
        self._graphed: dict = {}   # (signature, poison) -> graphs.Graphed
        self._grad_warned = False  # warned once that results carry no gradient
        if self.gemms is None:
            self.gemms = {}
        if self.graphs is None and not cuda_graphs.enabled_by_env():
            self.graphs = False
        self._pack = _packer(self.out_spec, len(self.graph.results))

    # -- running -------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if kwargs:
            raise TypeError(f"a compiled program takes its inputs by position, in the order of the example "
                            f"inputs it was compiled with; got keyword argument(s) {', '.join(kwargs)}")
        if self.guard is not None:
            why = self.guard()
            if why:
                self._recompile(args, why)
        tensors = args if all([type(a) is torch.Tensor for a in args]) else self._leaves(args)
        if not self._grad_warned and torch.is_grad_enabled() and any([t.requires_grad for t in tensors]):
            self._grad_warned = True
            warnings.warn("tilefuse: an input requires grad, but a compiled program has no backward: its results "
                          "carry no gradient (run it under torch.no_grad() or torch.inference_mode(), or detach "
                          "the inputs)", stacklevel=2)
        if self.graph.writes:
            why = overlapping_writes(self.graph, tensors)
            if why:
                raise OverlappingWrites(why)
        key = (signature(tensors), self.poison, self.graphs)
        run = self._entries.get(key)
        if run is None:
            run = self._entry(tensors, key)
        return self._pack(run(tensors))

    def with_graph(self, graph: ir.Graph, plan: Plan) -> "Program":
        """This program over a graph of other shapes but the same kernels and weights
        (runtime.resize): compiled kernels and device weights are shared, not looked up again."""
        other = replace(self, graph=graph, plan=plan)
        other._compiled, other._weights = self._compiled, self._weights
        return other

    def _recompile(self, args, why: str):
        """Weights changed since compiling: become the program compiled from them now (the
        caller's settings kept); without a way to rebuild, say so rather than run stale values."""
        check_inputs(self.graph, args if all([type(a) is torch.Tensor for a in args]) else self._leaves(args))
        if self.rebuild is None:
            raise ValueError(f"{why} since compiling; compile the program again")
        keep = {k: getattr(self, k) for k in ("poison", "graphs", "graph_slots", "graph_clone", "_grad_warned")}
        warnings.warn(f"tilefuse: {why} since compiling; compiling the program again (each time this "
                      f"happens: compile once the weights and the mode are final)", stacklevel=3)
        fresh = self.rebuild(args)
        self.__dict__.update(fresh.__dict__)
        self.__dict__.update(keep)
        self._entries.clear()
        if getattr(self, "stages", None) is not None:
            self.stages.program = self

    def _leaves(self, args) -> tuple:
        if self.inputs is None:
            return _tensor_leaves(args)
        out = []
        _match(self.inputs, args, "inputs", out)
        return tuple(out)

    def _entry(self, tensors, key):
        """First call with this signature: check the arguments (clear errors), build the runner."""
        device = check_inputs(self.graph, tensors)
        runner = self.runner(device)
        run = runner.run
        if self.graphs is not False:
            notes = cuda_graphs.blockers(self, device, auto=self.graphs is None)
            g = cuda_graphs.Graphed(runner, self.graph_slots, self.graph_clone)
            if notes:
                g.off = "; ".join(notes)
            else:
                run = g
            self._graphed[key[:2]] = g
        self._entries[key] = run
        return run

    def runner(self, device) -> Runner:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, self.poison)
        if key not in self._runners:
            self._runners[key] = Runner(self, device)
        return self._runners[key]

    def forget_graphs(self) -> None:
        """Drop the captured CUDA graphs and what the calls so far showed of their inputs'
        addresses: the next call warms up and captures afresh. `tilefuse run --bench` checks the
        program on copies of its inputs first, which left every input marked as moving and so
        copied into the graph on each timed call (a multi-kernel program's time counted an extra
        read and write of its inputs, a third of it for `x * sigmoid(s)`)."""
        self._entries.clear()
        self._graphed.clear()

    def graph_info(self) -> list[dict]:
        """Per input signature seen with graphs on: whether they run, why not, and call counts."""
        return [{"device": str(g.runner.device), "graphs": g.off is None, "reason": g.off,
                 "slots": len(g.slots), **g.stats} for g in self._graphed.values()]

    def weights_on(self, device) -> dict:
        key = str(device)
        if key not in self._weights:
            on = self.pool.on if self.pool is not None else lambda v, d: torch.as_tensor(v).to(d).contiguous()
            self._weights[key] = {k: _aligned(on(v, device)) for k, v in self.graph.weights.items()}
        return self._weights[key]

    def compiled(self, lowered: Lowered, device):
        """The kernel built under names made from what it computes (loop.canon.named_by_structure):
        kernels equal but for their names, as a model's layers repeat them, build once. Its
        parameters keep their order, which is all a launch binds by."""
        key = (lowered.kernel.name, str(device))
        if key not in self._compiled:
            from ..loop.canon import named_by_structure
            from .launch import compile_kernel

            kernel = named_by_structure(lowered.kernel)

            def build():
                sched = self.schedules(kernel, self.arch, device) if self.schedules else None
                return compile_kernel(kernel, arch=self.arch, schedule=sched)

            self._compiled[key] = _shared(("mapreduce", kernel, self.arch, str(device), self.schedules), build)
        return self._compiled[key]

    def compiled_gemm(self, lowered, device):
        """The generated GEMM for a planned step, compiled once per device: the TMA/wgmma
        kernel on sm_90a, the cp.async/mma.sync one (docs/gemm_sm80.md) on other GPUs from sm_80,
        and for a few rows of A (a decode step's projections) the GEMV (docs/gemm.md, "Short M")."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one key
            device = torch.device("cuda", torch.cuda.current_device())
        key = (lowered.epilogue.name, str(device))
        if key not in self._compiled:
            from ..codegen.gemm_sm90 import GemmError

            cap = torch.cuda.get_device_capability(device)
            problem = lowered.problem()
            short = cap >= (8, 0) and gemv_takes(problem)  # a few rows: B streamed by warps (codegen/gemv.py)

            def build():
                if short:
                    from .gemv import compile_gemv

                    return compile_gemv(problem, None, f"sm_{cap[0]}{cap[1]}")  # (sm_90 is built as sm_90a)
                if cap == (9, 0):
                    from .gemm import compile_gemm

                    sched = None
                    if self.schedules is not None:  # tuned knobs when `tilefuse tune` measured this GEMM here
                        from ..tune.lookup import tuned_gemm_schedule

                        sched = tuned_gemm_schedule(problem, "sm_90a", device)
                    return compile_gemm(problem, sched, "sm_90a")
                if cap >= (8, 0):
                    from .gemm_sm80 import compile_gemm_sm80

                    return compile_gemm_sm80(problem, None, f"sm_{cap[0]}{cap[1]}")
                raise GemmError(f"{lowered.epilogue.name}: generated GEMMs need an sm_80 or newer GPU; "
                                f"{torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}. "
                                f"TILEFUSE_GEMM=0 runs matmuls in cuBLAS")

            self._compiled[key] = _shared(("gemm", problem, problem.epilogue, cap, str(device),  # (problem's == skips it)
                                           self.schedules is not None, short), build)
        return self._compiled[key]

    def prepare(self, device="cuda"):
        """Compile every kernel for `device` now rather than at the first call, several at a
        time: NVRTC runs outside the GIL (the 4-layer Llama's 16 distinct kernels compiled
        cold in ~9 s one at a time)."""
        device = torch.device(device)
        index = None
        if device.type == "cuda":  # the caller's GPU: a worker thread's current device is GPU 0
            index = torch.cuda.current_device() if device.index is None else device.index
            device = torch.device("cuda", index)
        jobs = [(self.compiled, self.kernels[s.name], torch.device("cuda") if index is not None else device)
                if s.family == "mapreduce" else (self.compiled_gemm, self.gemms[s.name], device)
                for s in self.plan.steps if s.family in ("mapreduce", "gemm")]  # keyed as the runner asks

        def job(fn, lowered, dev):
            if index is not None:
                torch.cuda.set_device(index)  # this thread's current GPU: its arch, its tuned entries
            return fn(lowered, dev)

        workers = min(len(jobs), os.cpu_count() or 1, PREPARE_THREADS)
        if workers <= 1:
            for fn, lowered, dev in jobs:
                fn(lowered, dev)
        else:
            pool = ThreadPoolExecutor(workers, thread_name_prefix="tilefuse-compile")
            try:
                for f in [pool.submit(job, *j) for j in jobs]:
                    f.result()  # the first failure in plan order, as a sequential loop would raise it
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # the queued compiles are dropped
                raise
            pool.shutdown(wait=True)
        self._prepare_groups(device)

    def _prepare_groups(self, device):
        """Unless TILEFUSE_GEMV_GROUPS=0, the runner for `device` now, where two GEMMs of a few
        rows read one A: it compiles the groups of GEMVs it launches as one
        (runner.grouped_gemvs), which the first call would otherwise."""
        from ..codegen.gemv import MAX_M, groups_enabled

        a = [s.gemm.a for s in self.plan.steps if s.family == "gemm" and s.gemm is not None and s.gemm.m <= MAX_M]
        if device.type == "cuda" and groups_enabled() and len(set(a)) < len(a):
            self.runner(device)


class OverlappingWrites(ValueError):
    """A call whose inputs overlap one the program writes in place (raised before anything runs)."""


def overlapping_writes(graph: ir.Graph, tensors) -> str:
    """Why these inputs cannot run a program that writes some of them in place: a written input
    shares memory with another input (`x` and `x.t()`), whose reads the Graph IR takes as
    unchanged by the write; "" where none does."""
    if not graph.writes:
        return ""
    where = [t.untyped_storage().data_ptr() if t.numel() else -1 - i for i, t in enumerate(tensors)]
    if len(set(where)) == len(where):
        return ""
    for x in graph.writes:
        i = graph.inputs.index(x)
        for j, p in enumerate(where):
            if j != i and p == where[i]:
                return (f"input {x}, which the program writes in place, shares memory with input "
                        f"{graph.inputs[j]}; pass tensors that do not overlap")
    return ""


def _tensor_leaves(args) -> tuple:
    return tuple(a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor))


TENSOR = "<tensor>"


def skeleton(example):
    """The example inputs' nesting with each tensor as TENSOR (the tensors themselves are not
    kept alive), or None where it holds a container this matcher does not know (a registered
    pytree class): such inputs are flattened in pytree order."""
    if isinstance(example, torch.Tensor):
        return TENSOR
    if type(example) in (tuple, list):
        parts = [skeleton(e) for e in example]
        return None if None in parts else type(example)(parts)
    if type(example) is dict:
        parts = {k: skeleton(v) for k, v in example.items()}
        return None if None in parts.values() else parts
    return None


def _match(sk, arg, path: str, out: list):
    """A call's tensors in the order of the example's: dicts matched by key (a dict built in
    another order is the same argument), lists and tuples by position; a different nesting is
    a clear error, not a silent reordering."""
    if sk is TENSOR:
        if not isinstance(arg, torch.Tensor):
            raise ValueError(f"{path}: expected a tensor, as when compiling; got {type(arg).__name__}")
        out.append(arg)
    elif isinstance(sk, dict):
        if not isinstance(arg, dict) or set(arg) != set(sk):
            keys = lambda d: ", ".join(sorted(map(repr, d))) or "none"  # noqa: E731
            got = f"keys {keys(arg)}" if isinstance(arg, dict) else type(arg).__name__
            raise ValueError(f"{path}: expected a dict with keys {keys(sk)}, as when compiling; got {got}")
        for k, v in sk.items():
            _match(v, arg[k], f"{path}[{k!r}]", out)
    else:
        if not isinstance(arg, (tuple, list)) or len(arg) != len(sk):
            got = f"{len(arg)} items" if isinstance(arg, (tuple, list)) else type(arg).__name__
            raise ValueError(f"{path}: expected a {type(sk).__name__} of {len(sk)} items, as when compiling; got {got}")
        for i, (v, a) in enumerate(zip(sk, arg)):
            _match(v, a, f"{path}[{i}]", out)


def _packer(spec, n: int):
    """How to hand the flat outputs back: found once by unflattening placeholders."""
    if spec is None:
        return (lambda outs: outs[0]) if n == 1 else tuple
    try:
        probe = torch.utils._pytree.tree_unflatten(list(range(n)), spec)
    except Exception:  # noqa: BLE001 - an unusual spec: unflatten every call
        probe = None
    if n == 1 and type(probe) is int:
        return lambda outs: outs[0]
    if type(probe) is tuple and probe == tuple(range(n)):
        return tuple
    if type(probe) is list and probe == list(range(n)):
        return list
    return lambda outs: torch.utils._pytree.tree_unflatten(list(outs), spec)


def strided_view(n: ir.View, x: torch.Tensor) -> torch.Tensor:
    """A permute, expand or slice of x as PyTorch's strided view (no copy)."""
    if n.op == "permute":
        return x.permute(*n.params)
    if n.op == "expand":
        return x.expand(n.type.shape)
    if n.op == "slice":
        dim, start, end, step = n.params
        x = x.narrow(dim, start, end - start)
        return x if step == 1 else x[(slice(None),) * dim + (slice(None, None, step),)]
    if n.op == "roll":  # not a strided view: a copy (a roll no kernel reads in place)
        dim, shift = n.params
        return torch.roll(x, -shift, dim)
    raise ValueError(f"unknown view {n.op}")


def _exact_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """matmul of integer or bool operands, which PyTorch's matmul refuses on CUDA (no integer
    GEMM) and for bool anywhere, where eager reaches them through einsum: products summed in
    int64, then wrapped to the dtype (an integer matmul wraps) or tested for nonzero (bool)."""
    va, vb = a.dim() == 1, b.dim() == 1
    x = (a.unsqueeze(0) if va else a).long().unsqueeze(-1)
    y = (b.unsqueeze(-1) if vb else b).long().unsqueeze(-3)
    k = x.shape[-2]
    step = max(1, (1 << 26) // max(1, torch.broadcast_shapes(x.shape, y.shape).numel() // max(k, 1)))
    r = (x[..., :0, :] * y[..., :0, :]).sum(-2)  # zeros of the result's shape (K = 0 included)
    for i in range(0, k, step):  # a bounded slice of products at a time
        r += (x[..., i:i + step, :] * y[..., i:i + step, :]).sum(-2)
    if va or vb:
        r = r.reshape(()) if va and vb else r.squeeze(-2 if va else -1)
    return r != 0 if a.dtype == torch.bool else r.to(a.dtype)


# A one-off attention call (a program's first at its sizes: graphs.FIRST_CALL) runs on a backend
# that builds no per-shape plan. PyTorch's default on Hopper (2.11, cuDNN 9.19) is cuDNN's, which
# plans each new shape on the host before it runs: 65-70 ms for a causal prefill of ~2000-2300
# tokens (32 heads of 128), 35 ms for a one-token decode step at a new cache length, against
# 0.4-0.9 ms and 0.06-0.2 ms for flash and memory-efficient attention (H200,
# bench/results/s43/sdpa_first_call_h200.txt). A plan pays once a shape recurs: cuDNN ran that
# prefill in 120-142 us against flash's 314-358, so a captured program (replayed) keeps the
# default, and so does a one-off call whose attention is long enough for the plan to pay
# within a call of a few dozen layers (PLANLESS_MAX_FLOPS: flash's extra time there ~2 ms a call).
# A mask is taken where every query row keeps a key (_keeps_a_key: one reduction and a wait, on a
# call that would plan for 35-70 ms): how a row with every key masked comes out is the backend's
# choice, and a first call must give what its replays give.
PLANLESS = env.switch("TILEFUSE_PLANLESS_ATTENTION")
PLANLESS_MAX_FLOPS = 2.5e11
_PLANLESS_LOCK = threading.Lock()


def _attention_flops(q: torch.Tensor, k: torch.Tensor, causal: bool) -> float:
    f = 4.0 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
    return f / 2 if causal else f


def _keeps_a_key(mask: torch.Tensor) -> bool:
    """Whether every query row of an attention mask keeps at least one key (a bool mask's True, a
    float mask's value above -inf), so that every backend computes the same softmax over it."""
    kept = mask if mask.dtype == torch.bool else mask > float("-inf")
    return bool(kept.any(-1).all())


def _planless_attention(args, kw) -> torch.Tensor | None:
    """SDPA on flash or memory-efficient attention (those of them the process has enabled), or
    None where neither is enabled or takes these inputs. PyTorch's backend switches are the
    process's, not the thread's: the lock keeps two threads' first calls from restoring each
    other's switches out of order (another thread's own SDPA call in that window sees only these
    backends, or math if it is enabled: torch.backends.cuda.enable_math_sdp)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = torch.backends.cuda
    backends = [b for b, on in ((SDPBackend.FLASH_ATTENTION, cuda.flash_sdp_enabled()),
                                (SDPBackend.EFFICIENT_ATTENTION, cuda.mem_efficient_sdp_enabled())) if on]
    if not backends or not _planless_takes(args, kw):
        return None
    if cuda.math_sdp_enabled():
        backends.append(SDPBackend.MATH)  # (kept on for other threads: ours is taken by one above)
    with _PLANLESS_LOCK:
        try:
            with warnings.catch_warnings(), sdpa_kernel(backends):
                warnings.simplefilter("ignore")  # (why each was not used, before it gives up)
                return F.scaled_dot_product_attention(*args, **kw)
        except RuntimeError as e:
            if "No available kernel" not in str(e):
                raise
            return None


def _planless_takes(args, kw) -> bool:
    """Whether flash or memory-efficient attention takes these inputs (PyTorch's own checks)."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    q, k, v = args
    try:
        p = SDPAParams(q, k, v, kw["attn_mask"], 0.0, kw["is_causal"], kw["enable_gqa"])
    except TypeError:  # (another torch's signature: let the backends decide)
        return True
    return can_use_flash_attention(p, False) or can_use_efficient_attention(p, False)


# A sliding window (ir.Attention.window) runs on flash attention's own window (FlashAttention 2's
# local attention, `aten._flash_attention_forward`'s window_size_left), which visits only the key
# blocks of the band, where SDPA with the window as a mask visits them all. The op is PyTorch's
# private one, so it is first checked against SDPA with the mask, once a process for each device,
# dtype, head size and head grouping; where it is missing or disagrees, SDPA with the mask runs,
# and a warning says so. TILEFUSE_FLASH_WINDOW=0 always takes the mask.
FLASH_WINDOW = env.switch("TILEFUSE_FLASH_WINDOW")
_WINDOW_CHECKED: dict = {}


def _band(L: int, S: int, window: int, device) -> torch.Tensor:
    """[L, S] bool: query i keeps keys i - window < j <= i."""
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(S, device=device)
    return (j <= i) & (j > i - window)


def _flash_window(q, k, v, scale, window: int) -> torch.Tensor:
    """Causal attention to the last `window` keys, q, k and v [B, H, S, D] read as the [B, S, H, D]
    views flash attention takes (its output comes back in q's layout, viewed [B, H, S, D])."""
    out = torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, q.shape[-2], k.shape[-2], 0.0, True,
        False, scale=scale, window_size_left=window - 1, window_size_right=0)[0]
    return out.transpose(1, 2)


def _flash_window_takes(q, k, v) -> bool:
    D = q.shape[-1]
    return (q.is_cuda and q.dim() == k.dim() == v.dim() == 4 and q.dtype in (torch.bfloat16, torch.float16)
            and q.dtype == k.dtype == v.dtype and D % 8 == 0 and D <= 256 and k.shape[-1] == v.shape[-1] == D
            and q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1] and q.shape[0] == k.shape[0]
            and q.shape[-2] == k.shape[-2]  # (flash aligns its window to the last key; the band here, to the first)
            and all(t.stride(-1) == 1 for t in (q, k, v)))


def _flash_window_agrees(q, k) -> bool:
    """Whether flash attention's window gives what the mask gives (checked once: see above)."""
    key = (q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1])
    if key in _WINDOW_CHECKED:
        return _WINDOW_CHECKED[key]
    if torch.cuda.is_current_stream_capturing():
        return False  # (checked on a call that is not being captured)
    H, D, L, W = q.shape[1] // k.shape[1] * 2, q.shape[-1], 300, 5
    gen = torch.Generator(device=q.device).manual_seed(0)
    qq, kk, vv = (torch.randn(2, h, L, D, device=q.device, generator=gen).to(q.dtype) for h in (H, 2, 2))
    try:
        got = _flash_window(qq, kk, vv, 0.3, W).float()
        kr, vr = (t.float().repeat_interleave(H // 2, dim=1) for t in (kk, vv))
        want = F.scaled_dot_product_attention(qq.float(), kr, vr, attn_mask=_band(L, L, W, q.device), scale=0.3)
        ok = bool((got - want).abs().max() <= 0.05)
        why = "gives other values than the mask"
    except RuntimeError as e:
        ok, why = False, f"is not available ({str(e).splitlines()[0]})"
    if not ok:
        warnings.warn(f"tilefuse: flash attention's sliding window {why} on {torch.cuda.get_device_name(q.device)} "
                      f"({q.dtype}, head size {D}): windowed attention runs as SDPA with a mask", stacklevel=2)
    _WINDOW_CHECKED[key] = ok
    return ok


def _windowed_attention(n: ir.Attention, q, k, v) -> torch.Tensor:
    if FLASH_WINDOW and _flash_window_takes(q, k, v) and _flash_window_agrees(q, k):
        return _flash_window(q, k, v, n.scale, n.window)
    band = _band(q.shape[-2], k.shape[-2], n.window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=n.scale, enable_gqa=k.shape[-3] != q.shape[-3])


def run_extern(n, get) -> torch.Tensor:
    """Run one graph node in PyTorch: the explicit fallback the plan shows."""
    if isinstance(n, ir.Contraction):
        a, b = get(n.a), get(n.b)
        if a.dtype == torch.bool or (a.is_cuda and not a.is_floating_point()):
            return _exact_matmul(a, b)
        return torch.matmul(a, b)
    if isinstance(n, ir.Attention):
        q, k = get(n.q), get(n.k)
        if n.window:
            return _windowed_attention(n, q, k, get(n.v))
        args = (q, k, get(n.v))
        kw = dict(attn_mask=get(n.mask) if n.mask else None, is_causal=n.causal, scale=n.scale,
                  enable_gqa=k.shape[-3] != q.shape[-3])
        if (q.is_cuda and cuda_graphs.FIRST_CALL.get() and PLANLESS
                and _attention_flops(q, k, n.causal) <= PLANLESS_MAX_FLOPS
                and (n.mask is None or _keeps_a_key(kw["attn_mask"]))):
            out = _planless_attention(args, kw)
            if out is not None:
                return out
        return F.scaled_dot_product_attention(*args, **kw)
    if isinstance(n, ir.View):
        x = get(n.arg)
        if n.op == "reshape":
            return x.reshape(n.type.shape)
        return strided_view(n, x).contiguous()
    if isinstance(n, ir.Gather):
        # a dim where the node's type broadcasts one of them (size 1 beside a larger result)
        # takes the other's size as given now, not the compiled size: runtime/resize runs this
        # on a new size's meta tensors to find the result's shape there
        x, index = get(n.arg), get(n.index).long()
        wide = [d != n.axis and o > 1 for d, o in enumerate(n.type.shape)]
        x = x.expand([index.shape[d] if w and s == 1 else s for d, (s, w) in enumerate(zip(x.shape, wide))])
        index = index.expand([x.shape[d] if w and i == 1 else i for d, (i, w) in enumerate(zip(index.shape, wide))])
        if n.wrap:
            index = torch.where(index < 0, index + x.shape[n.axis], index)
        return torch.gather(x, n.axis, index)
    if isinstance(n, ir.Reduce):
        x = get(n.arg)
        kw = {"dtype": dtypes.to_torch(n.type.dtype)} if n.op in ("sum", "mean", "prod") and x.is_floating_point() else {}
        if n.op == "prod":  # (torch.prod takes one dim: the highest first, so the others keep their places)
            for a in sorted(n.axes, reverse=True):
                x = torch.prod(x, a, keepdim=n.keepdim, **kw)
            return x.to(dtypes.to_torch(n.type.dtype))
        fn = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}[n.op]
        return fn(x, dim=n.axes, keepdim=n.keepdim, **kw)
    if isinstance(n, ir.Scan):
        x = get(n.arg)
        if n.op in ("max", "min"):
            return (torch.cummax if n.op == "max" else torch.cummin)(x, n.axis).values
        fn = torch.cumsum if n.op == "sum" else torch.cumprod
        return fn(x, n.axis, dtype=dtypes.to_torch(n.type.dtype))
    if isinstance(n, ir.Map):
        if n.op == "cast":  # (graph.fusion.TORCH_MAPS)
            return get(n.args[0]).to(dtypes.to_torch(n.type.dtype))
        if n.op in _TORCH_LOGIC:
            return _TORCH_LOGIC[n.op](*(get(a) for a in n.args))
        raise TypeError(f"map {n.name} has no kernel")
    if isinstance(n, ir.Extern):
        kwargs = {k: _resolved(v, get) for k, v in n.kwargs}
        return n.torch_op()(*_resolved(n.args, get), **kwargs)
    raise TypeError(f"cannot run {n!r} in PyTorch")


# maps with a bool result, the same in PyTorch as in a kernel (graph.fusion.TORCH_MAPS)
_TORCH_LOGIC = {"not": torch.logical_not, "and": torch.logical_and, "or": torch.logical_or, "eq": torch.eq,
                "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}


def _resolved(a, get):
    """An extern's argument with each Ref replaced by its tensor. A module-level function: a
    nested one that calls itself is a reference cycle, which kept each call's environment (every
    intermediate tensor) alive until Python's cycle collector ran; a CUDA-graph slot whose
    results the caller had dropped then looked held (its use count changed) and was never
    replayed again."""
    if isinstance(a, ir.Ref):
        return get(a.name)
    if isinstance(a, tuple):
        return [_resolved(x, get) for x in a]
    return a
