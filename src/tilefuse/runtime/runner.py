"""The thin launch path: a program specialised once to a device, run with no per-call lookups.

A `Runner` turns the plan's named steps into a list of small ops over an environment
*list* (inputs first, then weights, constants and every step's outputs, each at a fixed
index). Everything that does not change between calls is computed when it is built:
weights and constants on the device, each kernel's parameter order, output shapes and
dtypes, which outputs must be returned as copies. A call then does only what it must:
allocate outputs, collect pointers, launch.

`check_inputs` gives the clear error for arguments that do not fit the program; the
program calls it only when a call's cheap signature (dtype, shape, device of each tensor)
is one it has not seen.
"""
from __future__ import annotations

import math
import operator

import torch

from .. import dtypes
from ..codegen import gemm_sm90
from ..graph import ir

_GIVEN = (ir.Input, ir.Weight, ir.Constant, ir.Iota)


def signature(tensors) -> tuple:
    """The cheap per-call key: (dtype, shape, device) of each tensor."""
    return tuple([(t.dtype, t.shape, t.device) for t in tensors])


def check_inputs(graph: ir.Graph, tensors) -> torch.device:
    """Raise ValueError naming the first argument that does not fit; return the common device."""
    if len(tensors) != len(graph.inputs):
        raise ValueError(f"expected {len(graph.inputs)} tensor inputs, got {len(tensors)}")
    for name, t in zip(graph.inputs, tensors):
        want = graph[name].type
        try:
            got = dtypes.from_torch(t.dtype)
        except Exception:  # a dtype tilefuse has no name for
            got = str(t.dtype)
        if tuple(t.shape) != want.shape or got != want.dtype:
            raise ValueError(f"input {name}: compiled for {want}, got {got}[{', '.join(map(str, t.shape))}]")
    device = tensors[0].device if tensors else torch.device("cpu")
    if any(t.device != device for t in tensors):
        raise ValueError("all inputs must be on one device; got "
                         + ", ".join(f"{n} on {t.device}" for n, t in zip(graph.inputs, tensors)))
    return device


def in_place_writes(graph: ir.Graph, plan) -> dict[str, str]:
    """Written values (Graph.writes) an extern can compute in the input's own memory: value ->
    input, where the value is `aten.op(x, ...)` whose `aten.op_` exists, of x's type, and
    nothing else reads x (no other op, alias or result: the old value is dead once the op
    starts). A static KV cache's `index_copy` then writes one token into the cache, not a copy of
    the whole cache that is then copied back."""
    users, found = graph.users(), {}
    extern_steps = {s.nodes[0] for s in plan.steps if s.family == "extern"}
    for x, v in graph.written:
        n = graph[v]
        if (isinstance(n, ir.Extern) and n.name in extern_steps and n.args and n.args[0] == ir.Ref(x)
                and n.type == graph[x].type and users[x] == [v] and x not in graph.results
                and v not in graph.results  # (a result never shares the caller's memory)
                and _in_place_op(n.target) is not None):
            found[v] = x
    return found


def _in_place_op(target: str):
    """aten.op_.overload for an extern's "aten.op.overload", or None where PyTorch has none."""
    ns, op, overload = (target.split(".") + ["", "", ""])[:3]
    return getattr(getattr(torch.ops.aten, op + "_", None), overload, None) if ns == "aten" else None


def read_through_aliases(graph: ir.Graph, plan) -> dict[str, str]:
    """Alias steps (free reshapes) that only kernels and other such reshapes read, alias -> its
    source: a kernel takes each input by pointer (or a contiguous copy of a strided one) and
    reads it in its own shape, so the source serves it as well and the runner runs no step for
    it (each reshape cost ~3-5 us of host time, ~40 a decode step: bench/thin_path.py). Kept: a
    result, a written input's new value, and a reshape of a written input (of a strided one, a
    reshape is a copy taken before the write)."""
    alias = {s.nodes[0]: graph[s.nodes[0]].arg for s in plan.steps if s.family == "alias"}
    if not alias:
        return {}
    step_of = {n: s for s in plan.steps for n in s.nodes}
    users = graph.users()
    kept = set(graph.results) | {v for _, v in graph.written}

    def root(a: str) -> str:
        while a in alias:
            a = alias[a]
        return a

    memo: dict[str, bool] = {}

    def free(a: str) -> bool:
        # (a reshape another kept reshape reads stays: of a strided source, the kept one must
        # view the contiguous copy this one makes, not the caller's tensor)
        if a not in memo:
            memo[a] = (a not in kept and root(a) not in graph.writes and bool(users[a])
                       and all((u in alias and free(u)) or (u in step_of and step_of[u].family in ("mapreduce", "gemm"))
                               for u in users[a]))
        return memo[a]

    return {a: src for a, src in alias.items() if free(a)}


def alias_root(plan, name: str) -> str:
    """Follow alias steps (free reshapes) back to the tensor whose memory `name` views."""
    src = {}
    for step in plan.steps:
        if step.family == "alias":
            n = plan.graph[step.nodes[0]]
            src[n.name] = n.arg
    while name in src:
        name = src[name]
    return name


def cloned_outputs(graph: ir.Graph, plan) -> tuple[bool, ...]:
    """Which results (`Graph.results`) are returned as copies: an input itself (never the caller's
    tensor), anything viewing a weight, constant or iota (never the program's cached value), or
    a view of an input the program writes (the write comes after the results)."""
    out = []
    for o in graph.results:
        root = graph[alias_root(plan, o)]
        viewed = graph[o]
        while isinstance(viewed, ir.View):  # (an extern view may return its input's memory: a slice's .contiguous())
            viewed = graph[viewed.arg]
        out.append(o in graph.inputs or (isinstance(root, _GIVEN) and not isinstance(root, ir.Input))
                   or viewed.name in graph.writes)  # a view of an input the program then writes
    return tuple(out)


class Runner:
    """One program on one device: `run(tensors)` returns the flat list of outputs."""

    def __init__(self, program, device: torch.device):
        g, plan = program.graph, program.plan
        self.device = device
        self.poison = program.poison
        index: dict[str, int] = {}
        for name in g.inputs:
            index[name] = len(index)
        base: list = [None] * len(index)
        skipped = read_through_aliases(g, plan)

        def slot(name: str) -> int:
            while name in skipped:  # a kernel reads the reshape's source: the same elements, in order
                name = skipped[name]
            if name not in index:
                index[name] = len(base)
                base.append(None)
            return index[name]

        for name, w in program.weights_on(device).items():
            base[slot(name)] = w
        for n in g.nodes:
            if isinstance(n, (ir.Constant, ir.Iota)):
                base[slot(n.name)] = _constant(n, device)
        self.ops = []
        strided = {s.nodes[0] for s in plan.steps if s.view}  # fusion.attention_only_views
        in_place = in_place_writes(g, plan)
        for step in plan.steps:
            if step.family == "alias":
                n = g[step.nodes[0]]
                if n.name not in skipped:
                    self.ops.append(_Alias(slot(n.arg), slot(n.name), n.type.shape))
            elif step.family == "extern" and step.nodes[0] in in_place:
                n = g[step.nodes[0]]
                self.ops.append(_InPlace(n, {a: slot(a) for a in ir.node_args(n)}, slot(n.name)))
            elif step.family == "extern":
                n = g[step.nodes[0]]
                self.ops.append(_Extern(n, {a: slot(a) for a in ir.node_args(n)}, slot(n.name),
                                        strided=n.name in strided))
            elif step.family == "gemm":
                lowered = program.gemms[step.name]
                if device.type == "cuda":
                    gk = program.compiled_gemm(lowered, device)
                    self.ops.append(_Gemm(gk, lowered, g, slot, device, program.poison))
                else:
                    self.ops.append(_InterpretGemm(lowered, g, slot))
            else:
                lowered = program.kernels[step.name]
                if device.type == "cuda":
                    ck = program.compiled(lowered, torch.device("cuda"))  # one compile serves every GPU
                    self.ops.append(_Launch(ck, lowered, g, slot, device, program.poison))
                else:
                    self.ops.append(_Interpret(lowered, g, slot))
        if device.type == "cuda":
            from ..codegen.gemv import groups_enabled

            if groups_enabled():
                self.ops = grouped_gemvs(self.ops, lambda members: _GemvGroup(members))
        self.base = base
        self.n_inputs = len(g.inputs)
        self.outputs = tuple((slot(o), c) for o, c in zip(g.results, cloned_outputs(g, plan)))
        # (input position, slot of its new value); positions of the inputs written at all
        self.written = tuple(g.inputs.index(x) for x in g.writes)
        # the new values to copy in after the run: not those an in-place extern wrote already
        self.copies = tuple((g.inputs.index(x), slot(v)) for x, v in g.written if v not in in_place)
        self.has_externs = any(s.family == "extern" for s in plan.steps)

    def run(self, tensors) -> list:
        env = self.base.copy()
        env[:self.n_inputs] = tensors
        for op in self.ops:
            op(env)
        out = [env[i].clone() if c else _unviewed(env[i]) for i, c in self.outputs]
        for i, v in self.copies:  # after the results: one naming a written input is it as given
            tensors[i].copy_(env[v])
        return out

    def prefilled(self) -> list:
        """The device tensors the runner holds (weights, constants): never a call's own memory."""
        return [t for t in self.base if t is not None]

    def gemm_workspace(self) -> tuple[int, int]:
        """The most split-K / stream-K partials (f32) and counters (int32) one of its GEMMs uses:
        what a CUDA-graph capture reserves for all of them (runtime.gemm.Workspace)."""
        srcs = [op.gk.source for op in self.ops if isinstance(op, _Gemm)]
        return (max((getattr(x, "workspace", 0) for x in srcs), default=0),
                max((getattr(x, "flags", 0) for x in srcs), default=0))


def _unviewed(t: torch.Tensor) -> torch.Tensor:
    """`t` with no view base (same memory): the replay of a CUDA graph returns its outputs
    detached, and a call on this path must return the same kind of tensor. Dynamo guards the
    base of a view it is given (an output fed back, as a KV cache is): a graph traced on a
    warm-up call's views failed its guards on replayed outputs and was traced again. Nor
    autograd history: an extern's output (a cat of an input that requires grad) would carry
    one, and a backward through it would count only part of the program."""
    return t.detach() if t._base is not None or t.requires_grad else t


def _device_index(device: torch.device) -> int:
    """The CUDA index a launch on `device` names ("cuda" alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _constant(n, device) -> torch.Tensor:
    tdtype = dtypes.to_torch(n.type.dtype)
    if isinstance(n, ir.Constant):
        return torch.tensor(n.value, dtype=tdtype, device=device)
    shape = n.type.shape
    idx = torch.arange(shape[n.axis], device=device, dtype=tdtype)
    view = [-1 if i == n.axis else 1 for i in range(len(shape))]
    return idx.reshape(view).expand(shape).contiguous()


class _InPlace:
    """An extern whose result is a written input's new value, run as its in-place op on that
    input (runner.in_place_writes): the result is the input tensor itself."""

    __slots__ = ("op", "node", "index", "dst", "args", "kwargs")

    def __init__(self, node, index, dst):
        self.node, self.index, self.dst = node, index, dst
        self.op = _in_place_op(node.target)
        self.args, self.kwargs = _bound_args(node, index)

    def __call__(self, env):
        args = self.args(env)
        self.op(*args, **self.kwargs(env))
        env[self.dst] = args[0]


class _Alias:
    __slots__ = ("src", "dst", "shape")

    def __init__(self, src, dst, shape):
        self.src, self.dst, self.shape = src, dst, shape

    def __call__(self, env):
        env[self.dst] = env[self.src].reshape(self.shape)


class _Extern:
    """One node run in PyTorch. Its call is bound when the runner is built (the torch op looked
    up, each argument an index into the environment): a decode step runs ~30 of these, and
    resolving them per call cost about as much as the op (bench/thin_path.py)."""

    __slots__ = ("node", "index", "dst", "dtype", "shape", "strided", "call")

    def __init__(self, node, index, dst, strided: bool = False):
        self.node, self.index, self.dst = node, index, dst
        self.dtype, self.shape = dtypes.to_torch(node.type.dtype), node.type.shape
        self.strided = strided
        self.call = _bound_extern(node, index, strided)

    def __call__(self, env):
        out = self.call(env)
        if not self.strided:  # (a view for attention, fusion.attention_only_views, is taken as it is)
            if out.dtype != self.dtype:
                out = out.to(self.dtype)
            if out.shape != self.shape:
                out = out.reshape(self.shape)
        env[self.dst] = out


def _bound_extern(n, index: dict, strided: bool):
    """env -> the node's value in PyTorch, as program.run_extern computes it."""
    from .program import run_extern, strided_view

    if isinstance(n, ir.View):
        i, shape = index[n.arg], n.type.shape
        if strided:
            return lambda env: strided_view(n, env[i])
        if n.op == "reshape":
            return lambda env: env[i].reshape(shape)
        return lambda env: strided_view(n, env[i]).contiguous()
    if isinstance(n, ir.Extern):
        fn = n.torch_op()
        args, kwargs = _bound_args(n, index)
        return lambda env: fn(*args(env), **kwargs(env))
    return lambda env: run_extern(n, lambda a: env[index[a]])


def _bound_args(n: ir.Extern, index: dict):
    """(env -> positional arguments, env -> keyword arguments) of an aten extern."""
    kwargs = tuple((k, _binder(v, index)) for k, v in n.kwargs)
    return _binder(n.args, index), lambda env: {k: v(env) for k, v in kwargs}


def _binder(a, index: dict):
    """env -> an extern argument with each Ref replaced by its tensor (tuples as lists, as
    program._resolved gives them)."""
    if isinstance(a, ir.Ref):
        return operator.itemgetter(index[a.name])
    if isinstance(a, tuple):
        if not any(isinstance(x, (ir.Ref, tuple)) for x in a):
            value = list(a)
            return lambda env: list(value)
        parts = tuple(_binder(x, index) for x in a)
        return lambda env: [f(env) for f in parts]
    return lambda env: a


_IN, _OUT = 0, 1


class _Launch:
    """One generated kernel: parameters in the kernel's order, outputs allocated per call."""

    __slots__ = ("ck", "params", "device", "index", "poison", "workspace")

    def __init__(self, ck, lowered, g: ir.Graph, slot, device: torch.device, poison: bool):
        k = lowered.kernel
        params = []
        for b in lowered.bindings:
            buf = k.buffer(b.buffer)
            gshape = g[b.tensor].type.shape
            if math.prod(b.shape) != math.prod(gshape):
                raise AssertionError(f"kernel {k.name}: binding {b.buffer} views {b.tensor}{gshape} as {b.shape}")
            if buf.role == "in":
                params.append((_IN, slot(b.tensor), None, None, 0.0))
            else:
                fill = float("nan") if dtypes.is_float(buf.dtype) else -1
                params.append((_OUT, slot(b.tensor), gshape, dtypes.to_torch(buf.dtype), fill))
        if [b.buffer for b in lowered.bindings] != [b.name for b in k.params]:
            raise AssertionError(f"kernel {k.name}: bindings are not in parameter order")
        self.ck, self.params, self.device, self.poison = ck, tuple(params), device, poison
        self.index = _device_index(device)
        # a grid reduction's counters, partials and per-row values: made (zeroed) with the runner,
        # one per program and device, so two programs never share counters; the kernel leaves
        # the counters at zero, so launches and CUDA-graph replays need no memset
        nbytes = getattr(getattr(ck, "source", None), "workspace_bytes", 0)  # stand-in kernels have no source
        from .launch import new_workspace

        self.workspace = new_workspace(nbytes, device) if nbytes else None

    def __call__(self, env):
        ptrs, keep = [], []
        for kind, i, shape, dtype, fill in self.params:
            if kind == _IN:
                t = env[i]
                if not t.is_contiguous():
                    t = t.contiguous()
                    keep.append(t)  # alive until the launch is enqueued; the allocator is stream-ordered
            else:
                t = torch.empty(shape, dtype=dtype, device=self.device)
                if self.poison:
                    t.fill_(fill)
                env[i] = t
            ptrs.append(t.data_ptr())
        if self.workspace is not None:
            ptrs.append(self.workspace.data_ptr())
        self.ck.launch_ptrs(self.index, ptrs)


class _Gemm:
    """One generated GEMM: A and B viewed as the GEMM reads them, the epilogue's operands and
    outputs by name."""

    __slots__ = ("gk", "a", "b", "ashape", "bshape", "operands", "outs", "device", "poison", "packed", "fixed",
                 "order", "index", "per_call")

    def __init__(self, gk, lowered, g: ir.Graph, slot, device: torch.device, poison: bool):
        s = lowered.spec
        self.gk, self.device, self.poison = gk, device, poison
        self.a, self.b = slot(s.a), slot(s.b)
        self.ashape, self.bshape = lowered.operand_shapes()
        outs = lowered.outputs
        self.operands = tuple((b.buffer, slot(b.tensor), b.shape) for b in lowered.bindings if b not in outs)
        # tables the kernel reads column-permuted (gemm_sm90.packed_tables): weights and
        # constants are permuted once, on the first call; anything else by the kernel, per call
        tables = dict(getattr(gk.source, "packed_tables", ()))
        self.packed = {b.buffer: tables[b.buffer] for b in lowered.bindings
                       if b.buffer in tables and isinstance(g[b.tensor], (ir.Weight, ir.Constant))}
        self.fixed: dict = {}
        self.per_call = any(name not in self.packed for name in tables)  # packed by the checked call, each call
        self.outs = tuple((b.buffer, slot(b.tensor), g[b.tensor].type.shape, b.shape,
                           dtypes.to_torch(lowered.epilogue.buffer(b.buffer).dtype)) for b in outs)
        # the kernel's parameters in its order: (is an output, env index, shape, dtype, the name
        # where it is a table packed once, else None)
        made = {name: (i, shape, dtype) for name, i, shape, _, dtype in self.outs}
        given = {name: (i, shape) for name, i, shape in self.operands}
        self.order = tuple((True, *made[n], None) if n in made else (False, *given[n], None, n if n in self.packed else None)
                           for n in gk.source.params)
        self.index = _device_index(device)

    @staticmethod
    def _operand(t, shape):
        t = t.reshape(shape)
        if not t.is_contiguous() or t.data_ptr() % 16:
            t = t.contiguous() if not t.is_contiguous() else t.clone()
        return t

    @staticmethod
    def _ptr(t, shape, keep: list) -> int:
        """The pointer the kernel reads `t` at: its own where it is contiguous and 16-byte aligned
        (a reshape of it would share it), else a copy's, kept alive until the launch is queued."""
        if t.is_contiguous():
            p = t.data_ptr()
            if not p % 16:
                return p
        t = _Gemm._operand(t, shape)
        keep.append(t)
        return t.data_ptr()

    def __call__(self, env):
        """Pointers in the kernel's parameter order and one launch: the runner's tensors have the
        graph's shapes and dtypes, so nothing is checked per call (`GemmKernel.__call__` would,
        ~25 us of a decode step's GEMM: bench/thin_path.py)."""
        if self.per_call or len(self.fixed) < len(self.packed):  # tables to pack: the checked call packs them
            return self._checked(env)
        keep: list = []
        ptrs = [self._ptr(env[self.a], self.ashape, keep), self._ptr(env[self.b], self.bshape, keep)]
        self.params_into(env, ptrs, keep)
        self.gk.launch_ptrs(self.index, ptrs)

    def params_into(self, env, ptrs: list, keep: list) -> None:
        """Append the epilogue's pointers in the kernel's order, allocating its outputs into env."""
        for made, i, shape, dtype, packed in self.order:
            if made:
                t = env[i] = torch.empty(shape, dtype=dtype, device=self.device)
                if self.poison:
                    t.fill_(float("nan"))
                ptrs.append(t.data_ptr())
            elif packed is not None:
                ptrs.append(self.fixed[packed].data_ptr())
            else:
                ptrs.append(self._ptr(env[i], shape, keep))

    def _checked(self, env):
        kw = {name: self._operand(env[i], shape) for name, i, shape in self.operands}
        for name, w in self.packed.items():
            if name not in self.fixed:
                if torch.cuda.is_current_stream_capturing():
                    continue  # a graph would only record the packing: the kernel packs it in the graph
                self.fixed[name] = gemm_sm90.pack_table(kw[name], w)
                torch.cuda.current_stream().synchronize()  # once: ready for calls on any stream
            kw[name] = self.fixed[name]
        for name, i, shape, view, dtype in self.outs:
            out = torch.empty(shape, dtype=dtype, device=self.device)
            if self.poison:
                out.fill_(float("nan"))
            env[i] = out
            kw[name] = out.view(view)
        self.gk(self._operand(env[self.a], self.ashape), self._operand(env[self.b], self.bshape),
                prepacked=self.fixed.keys(), **kw)


class _InterpretGemm:
    """A GEMM on CPU tensors: the product in float32 by torch, the epilogue by the Loop IR interpreter."""

    def __init__(self, lowered, g: ir.Graph, slot):
        s = lowered.spec
        self.lowered = lowered
        self.a, self.b = slot(s.a), slot(s.b)
        outs = lowered.outputs
        self.operands = [(b.buffer, slot(b.tensor), b.shape) for b in lowered.bindings if b not in outs]
        self.outs = [(b.buffer, slot(b.tensor), g[b.tensor].type.shape) for b in outs]

    def __call__(self, env):
        from ..loop.interp import run_kernel
        from ..tensors import to_numpy, to_torch

        lw = self.lowered
        ashape, bshape = lw.operand_shapes()
        a = env[self.a].reshape(ashape).float()
        b = env[self.b].reshape(bshape).float()
        acc = a @ (b.transpose(-1, -2) if lw.spec.b_major == "K" else b)
        ins = {"acc": acc.numpy()}
        ins.update({buf: to_numpy(env[i].reshape(shape)) for buf, i, shape in self.operands})
        outs = run_kernel(lw.epilogue, ins)
        for buf, i, shape in self.outs:
            env[i] = to_torch(outs[buf]).reshape(shape)


class _Interpret:
    """One kernel through the Loop IR interpreter (CPU tensors)."""

    def __init__(self, lowered, g: ir.Graph, slot):
        k = lowered.kernel
        self.kernel = k
        self.ins = [(b.buffer, slot(b.tensor), b.shape) for b in lowered.bindings if k.buffer(b.buffer).role == "in"]
        self.outs = [(b.buffer, slot(b.tensor), g[b.tensor].type.shape) for b in lowered.bindings
                     if k.buffer(b.buffer).role == "out"]

    def __call__(self, env):
        from ..loop.interp import run_kernel
        from ..tensors import to_numpy, to_torch

        outs = run_kernel(self.kernel, {buf: to_numpy(env[i].reshape(shape)) for buf, i, shape in self.ins})
        for buf, i, shape in self.outs:
            env[i] = to_torch(outs[buf]).reshape(shape)


def grouped_gemvs(ops: list, make) -> list:
    """`ops` with each run of two or more consecutive GEMV launches that read one A (same
    environment slot and shape), none reading what an earlier one of the run writes, replaced
    by make(run): one launch for all (gemv.render_group). Only plain thin-path GEMV ops join
    (no tables packed per call). A run whose group fails to build keeps its launches, with a
    warning that says why."""
    from .gemv import GemvGroupKernel, GemvKernel

    def joins(op) -> bool:
        return (isinstance(op, _Gemm) and isinstance(op.gk, GemvKernel) and not isinstance(op.gk, GemvGroupKernel)
                and not op.packed and not op.per_call)

    out, run = [], []

    def close():
        if len(run) > 1:
            try:
                out.append(make(tuple(run)))
            except Exception as e:  # (a group that does not build: its members launch one by one)
                import warnings

                warnings.warn(f"tilefuse: {len(run)} GEMVs of one A run one by one: their group did not build "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", stacklevel=2)
                out.extend(run)
        else:
            out.extend(run)
        run.clear()

    for op in ops:
        if joins(op) and run and (op.a, op.ashape) == (run[0].a, run[0].ashape):
            written = {i for r in run for made, i, *_ in r.order if made}
            read = {op.b} | {i for made, i, *_ in op.order if not made}
            if not read & written:
                run.append(op)
                continue
        close()
        if joins(op):
            run.append(op)
        else:
            out.append(op)
    close()
    return out


class _GemvGroup:
    """Consecutive GEMVs of one A (grouped_gemvs) as one launch: A, then each member's B and
    parameters in its own order, as its _Gemm would pass them."""

    __slots__ = ("gk", "members", "index")

    def __init__(self, members):
        from .gemv import compile_gemv_group

        first = members[0]
        self.members, self.index = members, first.index
        self.gk = compile_gemv_group([m.gk.source.problem for m in members], None, first.gk.source.arch)

    def __call__(self, env):
        keep: list = []
        first = self.members[0]
        ptrs = [_Gemm._ptr(env[first.a], first.ashape, keep)]
        for m in self.members:
            ptrs.append(_Gemm._ptr(env[m.b], m.bshape, keep))
            m.params_into(env, ptrs, keep)
        self.gk.launch_ptrs(self.index, ptrs)

