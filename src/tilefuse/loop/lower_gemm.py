"""Lower a planned GEMM step to its epilogue program (Loop IR) and the GEMM problem it runs as.

The epilogue reads the fp32 accumulator as `acc` and computes every fused map in fp32, as the
map-reduce lowering does for bf16/f16 values: a value is rounded to a narrower float only
where the graph casts it explicitly, and once where it is stored. Operands are renamed
`in_0`, `in_1`, ... and the outputs `out` (or `out0`, `out1`, ...), so the kernel's text does
not depend on the graph's names (equal programs share a cubin and a tuning entry). A tile
operand that broadcasts a tensor through views (`GemmSpec.viewed`) binds that tensor, read at
the index the views compose to (loop/views.py): RoPE's cos[m % S, n % (D/2)]. A GEMM whose
epilogue ends in partial row reductions (`GemmSpec.partials`) reduces the value per column
group: cross-entropy's (EpilogueBuilder.partial_lse / partial_select) store only those,
RMSNorm's sum of squares (partial_sum) is stored beside the value.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..codegen.epilogue import EpilogueBuilder
from ..graph import ir as g_ir
from ..graph.contraction import GemmSpec
from ..graph.fusion import Step
from . import ir as L
from .lower import Binding
from .views import read_index


@dataclass(frozen=True)
class LoweredGemm:
    spec: GemmSpec
    epilogue: L.Kernel
    bindings: tuple[Binding, ...]  # the epilogue's operands and output (not acc)
    b_const: bool = False          # B is a weight of the graph: no kernel of the program writes it

    @property
    def outputs(self) -> tuple[Binding, ...]:
        """The bindings of the tensors it writes, in graph order."""
        return tuple(b for b in self.bindings if self.epilogue.buffer(b.buffer).role == "out")

    def problem(self):
        """The GemmProblem the sm_90a template renders. Its epilogue is named by its stem
        (loop.canon.stem: `tf_k17_matmul_4_glu_acc_epilogue` -> `tf_matmul_glu_acc_epilogue`),
        not by its step: the source writes the epilogue's name, and a model's layers repeat each
        GEMM with an epilogue equal but for that name, so they render one source, build once
        (NVRTC) and share one cubin. A weight as B (`b_const`) has its first stages loaded
        before the kernel waits for the one before it (gemm_sm90.prefetch_b). (No structural digest: it counts M, which an M-argument
        source leaves out; the body follows the name in the source.)"""
        from ..codegen.gemm_sm90 import GemmProblem
        from .canon import stem

        s = self.spec
        epilogue = replace(self.epilogue, name=stem(self.epilogue.name))
        return GemmProblem(s.m, s.n, s.k, s.dtype, s.b_major, s.batch, epilogue, b_const=self.b_const)

    def operand_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """a and B as the GEMM reads them: [batch,] M x K and [batch,] N x K or K x N."""
        s = self.spec
        lead = (s.batch,) if s.batch > 1 else ()
        b = (s.n, s.k) if s.b_major == "K" else (s.k, s.n)
        return lead + (s.m, s.k), lead + b




def lower_gemm_step(graph: g_ir.Graph, step: Step, name: str | None = None) -> LoweredGemm:
    if step.family != "gemm" or step.gemm is None:
        raise ValueError(f"step {step.name} is {step.family}, not a GEMM")
    s = step.gemm
    e = EpilogueBuilder(s.m, s.n, s.batch, pairwise=s.pairwise is not None)
    # In a pairwise epilogue each full-width value exists twice per output element, once for
    # each accumulator column of the pair: its values are keyed by (name, 0) and (name, 1).
    parity = {x: p for p, x in enumerate(s.pairwise or ())}
    # a stack of two half-width results viewed back to full width: at parity p, the p-th of them
    stacked = {view: (even, odd) for _, view, even, odd in s.stacks}
    values: dict[tuple, str] = {}
    kinds = {t: k for t, k in s.operands if k != "view"}  # operands read directly, by kind
    through = dict(s.viewed)  # operands read through views -> the tensor under them
    # one buffer per (tensor, kind) bound; never an SSA name of the builder (a1, x2, t3...)
    bufs = {op: f"in_{i}" for i, op in enumerate(s.operands)}
    bindings = []

    def below(key: tuple) -> tuple:
        """The (value, parity) keys `key` is computed from, as `value` recurses into them."""
        arg, p = key
        if key in values or arg == s.contraction or arg in kinds or arg in through:
            return ()
        if arg in parity:
            return ((graph[arg].arg, parity[arg]),)
        if arg in stacked:
            return ((stacked[arg][p], None),)
        n = graph[arg]
        return () if isinstance(n, g_ir.Constant) else tuple((a, p) for a in n.args if (a, p) not in values)

    def value(arg: str, p) -> str:
        key = (arg, p)
        if key in values:
            return values[key]
        for k in g_ir.post_order(key, below)[:-1]:  # a long chain valued from its far end: no deep recursion
            value(*k)
        n = graph[arg]
        if arg == s.contraction:
            v = e.acc(p)
        elif arg in parity:
            v = value(n.arg, parity[arg])
        elif arg in stacked:
            v = value(stacked[arg][p], None)
        elif isinstance(n, g_ir.Constant):
            v = e.const(float(n.value))  # as given: a weak bf16/f16 Constant keeps its value
        elif arg in kinds:  # parity p: a full-width operand of a pairwise epilogue, at column 2n + p
            v = e.load(bufs[(arg, kinds[arg])], kinds[arg], n.type.dtype, pair=p)
        elif arg in through:  # the tensor under the views, at the element the tile index reaches
            src = graph[through[arg]].type
            index, shape = e.tile(p)
            v = e.load_at(bufs[(through[arg], "view")], src.shape, src.dtype,
                          read_index(graph, arg, shape, index, e.extents))
        else:
            v = emit(n, p)
        values[key] = v
        return v

    def emit(n, p) -> str:
        args = [value(a, p) for a in n.args]
        if n.op == "cast":
            v = args[0]
            if (graph[n.args[0]].type.dtype == "bool") != (n.type.dtype == "bool"):  # a truth value made a number, or back
                return e.op("cast", v, dtype="bool" if n.type.dtype == "bool" else "f32")
            if n.type.dtype in ("bf16", "f16") and n.name not in s.outs:  # an explicit rounding inside the chain
                v = e.op("cast", e.op("cast", v, dtype=n.type.dtype), dtype="f32")
            return v
        return e.op(n.op, *args, dtype="bool" if n.type.dtype == "bool" else "f32")  # (a comparison: bool)

    # outputs are half-width in a pairwise epilogue (parity None), but for what a stack made
    # full width again: those are stored at columns 2n and 2n + 1
    names = ["out"] if len(s.outs) == 1 else [f"out{i}" for i in range(len(s.outs))]
    part_outs = {o for _, outs, _ in s.partials for o in outs}
    for buf, o in zip(names, s.outs):  # (cross-entropy's partials store nothing else)
        if o in part_outs:
            continue
        if s.pairwise and graph[o].type.shape[-1] == s.n:
            for p in (0, 1):
                e.store(buf, value(o, p), graph[o].type.dtype, pair=p)
        else:
            e.store(buf, value(o, None), graph[o].type.dtype)
    if s.partials:  # the epilogue's value reduced per column group
        for o in s.outs:  # what the partials compute from a stored output, they read as stored
            dt = graph[o].type.dtype
            if o not in part_outs and (o, None) in values and dt in ("bf16", "f16"):
                values[(o, None)] = e.op("cast", e.op("cast", values[(o, None)], dtype=dt), dtype="f32")
        y = value(s.partial_of, None)
        buf_of = dict(zip(s.outs, names))
        for kind, outs, arg in s.partials:
            if kind == "lse":
                e.partial_lse(buf_of[outs[0]], buf_of[outs[1]], y, s.partial_width)
            elif kind == "select":
                e.partial_select(buf_of[outs[0]], y, bufs[(arg, "target")], s.partial_width)
            elif kind == "sum":
                e.partial_sum(buf_of[outs[0]], value(arg, None), s.partial_width)
            else:
                raise ValueError(f"step {step.name}: unknown partial {kind!r}")
    kernel = e.kernel(name or f"epilogue_{step.name}")
    for (t, _), b in bufs.items():
        bindings.append(Binding(b, t, kernel.buffer(b).shape))
    # (a partial's output is stored at [m, t]: its shape is the graph tensor's, [M, T])
    for buf, o in zip(names, s.outs):
        bindings.append(Binding(buf, o, kernel.buffer(buf).shape))
    notes = tuple(f"{m}: {graph[m].describe()}" for m in (s.contraction,) + s.maps)
    kernel = L.Kernel(kernel.name, kernel.params, kernel.body, kernel.family, notes=notes)
    return LoweredGemm(s, kernel, tuple(bindings), b_const=s.b in graph.weights)
