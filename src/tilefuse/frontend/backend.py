"""torch.compile(model, backend="tilefuse"): dynamo's FX graphs through tilefuse's pipeline.

Dynamo hands a backend one GraphModule per captured region (each graph break makes
another) with example inputs: the user's tensors, the module's parameters and buffers
(lifted to inputs), and SymInts where a size is dynamic. Here parameters and buffers
become Graph IR weights, prepared once per compilation; a different tensor or an in-place
update of one (its version counter moves) compiles again, so a weight folded at compile
time never goes stale. Dynamic sizes are specialised: each concrete size compiles once, or,
where only extern ops see the sizes change, is made from a compiled size's program with no
compile (runtime/resize.py).

What tilefuse cannot take runs in eager, visibly: a graph it cannot compile at all runs as
the GraphModule's own forward, with the reason logged; inside a compiled graph, every op
without a tilefuse kernel is an explicit extern step. `TILEFUSE_LOG=summary` prints, per
graph, the fused kernels, the externs grouped by reason and every fallback.
"""
from __future__ import annotations

import sys
import time
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from .. import env
from ..graph.rules.match import interning
from ..runtime.program import OverlappingWrites
from ..runtime.shared_weights import WeightPool, storages

NAME = "tilefuse"
MAX_VARIANTS = 64  # compiled variants (sizes x weight sets) kept per graph before new ones run in eager
MAX_MADE = 1024  # sizes made with no compile (runtime.resize), per graph, before new ones run in eager
PROLOGUE_BYTES = 64 << 20  # the size prologue's results kept for reuse, per graph (a mask per length)
REFUSED_AFTER = 2  # sizes failing for one reason before a graph's new sizes stop being tried
POOL = WeightPool()  # weights derived at compile time, shared by every graph's and size's programs


# -- reports --------------------------------------------------------------------------------------


@dataclass
class GraphReport:
    """What happened to one dynamo graph: compiled variants, what runs where, fallbacks."""

    index: int
    fx_ops: int
    status: str = "pending"  # "tilefuse" | "eager" | "pending" (dynamic sizes compile at the first call)
    reason: str = ""
    kernels: int = 0  # fused tilefuse kernels of the last compiled variant
    fused_ops: int = 0  # Graph IR ops inside those kernels
    externs: Counter = field(default_factory=Counter)  # (what, why) -> count
    aliases: int = 0
    views: Counter = field(default_factory=Counter)  # strided views (no launch, no copy): (what, why) -> count
    compile_s: float = 0.0
    variants: int = 0
    exports: int = 0  # torch.export runs: one for all sizes where a symbolic export serves them (frontend.sizes)
    resized: int = 0  # variants made from another size's program with no compile (runtime.resize)
    calls_tilefuse: int = 0
    calls_eager: int = 0
    events: list[str] = field(default_factory=list)
    inference_weights: bool = False  # compiled with weights that keep no version counter (said once)
    runner: object = field(default=None, repr=False, compare=False)  # weakref to its GraphRunner

    @property
    def stages(self):
        """The last compiled variant's tilefuse.compiler.Compiled, while dynamo keeps the graph
        (None after torch._dynamo.reset()): the reports outlive the graphs, and holding the
        stages here kept every program, with its derived weights, for the whole process."""
        runner = self.runner() if self.runner is not None else None
        return getattr(runner, "stages", None)

    def line(self) -> str:
        head = f"graph {self.index} ({self.fx_ops} fx ops)"
        if self.status == "eager" and not self.variants:
            return f"{head}: eager fallback: {self.reason}"
        if self.status == "pending":
            return f"{head}: compiles at the first call of each size ({self.reason})"
        ext, views = sum(self.externs.values()), sum(self.views.values())
        text = (f"{head}: {self.kernels} tilefuse kernel(s) fusing {self.fused_ops} op(s), "
                f"{ext} extern(s), {self.aliases} alias(es)" + (f", {views} strided view(s)" if views else "")
                + f"; compiled in {self.compile_s:.2f} s")
        for (what, why), n in sorted(self.externs.items(), key=lambda kv: -kv[1]):
            text += f"\n    extern {n}x {what}: {why}"
        for (what, why), n in sorted(self.views.items(), key=lambda kv: -kv[1]):
            text += f"\n    view {n}x {what}: {why}"
        return text


REPORTS: list[GraphReport] = []
_seen_breaks: Counter = Counter()
_breaks_before: Counter = Counter()  # dynamo's counts at the last reset(): torch._dynamo.reset() keeps them


def reports() -> list[GraphReport]:
    """Every graph the backend has seen in this process, in order."""
    return list(REPORTS)


def reset() -> None:
    """Forget the reports and the graph breaks seen so far (dynamo's own caches are reset with
    torch._dynamo.reset())."""
    REPORTS.clear()
    _WARNED_TRAINING.clear()
    _seen_breaks.clear()
    _breaks_before.clear()
    _breaks_before.update(_graph_breaks())


def summary() -> str:
    """All graphs so far: kernels, externs, fallbacks, and dynamo's graph breaks."""
    lines = [f"tilefuse backend: {len(REPORTS)} graph(s), "
             f"{sum(r.status == 'tilefuse' for r in REPORTS)} compiled, "
             f"{sum(r.status == 'eager' for r in REPORTS)} in eager"]
    for r in REPORTS:
        lines.append("  " + r.line().replace("\n", "\n  "))
        lines.append(f"    calls: {r.calls_tilefuse} through tilefuse, {r.calls_eager} in eager"
                     + (f"; {r.variants} compiled variant(s) from {r.exports} export(s)" if r.variants > 1 else "")
                     + (f", {r.resized} of them resized with no compile" if r.resized else ""))
    lines += [f"  {e}" for r in REPORTS for e in r.events]
    breaks = _graph_breaks()
    if breaks:
        lines.append(f"  dynamo graph breaks: {sum(breaks.values())}")
        lines += [f"    {n}x {why}" for why, n in breaks.items()]
    return "\n".join(lines)


def _logging() -> bool:
    return "summary" in [w.strip() for w in env.raw("TILEFUSE_LOG").lower().split(",")]


def _log(msg: str) -> None:
    if _logging():
        print(f"tilefuse: {msg}", file=sys.stderr, flush=True)


_WARNED_TRAINING = []
_TRAINING = ("training graph (grad mode on and inputs that require grad): tilefuse has no backward yet; run "
             "inference under torch.no_grad() or torch.inference_mode()")


def _warn_training(why: str) -> None:
    """Once a process: a model called with grad on (no torch.no_grad()) runs every graph in
    eager, which without TILEFUSE_LOG would pass unseen (tilefuse.compile warns likewise)."""
    if not _WARNED_TRAINING:
        _WARNED_TRAINING.append(True)
        warnings.warn(f"tilefuse: a graph runs in eager: {why} (TILEFUSE_LOG=summary lists every graph)",
                      RuntimeWarning, stacklevel=2)


def _graph_breaks() -> Counter:
    """dynamo's graph-break reasons since the last reset(), each as its first line and its
    explanation; the regions between graphs run in eager. dynamo files some breaks (a
    data-dependent `if`) as "unimplemented", not "graph_break": both count."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return Counter()
    out: Counter = Counter()
    for kind in ("graph_break", "unimplemented"):
        for why, n in counters.get(kind, {}).items():
            out[_reason(str(why))] += n
    return out - _breaks_before


def _reason(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    if not lines:
        return "?"
    expl = next((x.split(":", 1)[1].strip() for x in lines[1:] if x.startswith("Explanation:")), "")
    head = f"{lines[0]}: {expl}" if expl else lines[0]
    return head if len(head) <= 200 else head[:197] + "..."


def _log_new_breaks() -> None:
    breaks = _graph_breaks()
    new = breaks - _seen_breaks
    _seen_breaks.update(new)
    for why, n in new.items():
        _log(f"dynamo graph break ({n}x, the code around it runs in eager): {why}")


# -- the backend ----------------------------------------------------------------------------------


def tilefuse_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
    """The torch.compile backend: returns a callable with the GraphModule's signature.

    `options` (torch.compile(..., options={...})): "arch" picks the GPU architecture.
    """
    options = dict(options or {})
    unknown = set(options) - {"arch"}
    if unknown:
        raise ValueError(f"tilefuse backend: unknown option(s) {sorted(unknown)}; known: ['arch']")
    _log_new_breaks()
    return GraphRunner(gm, list(example_inputs), arch=options.get("arch"))


def register() -> None:
    """Make backend="tilefuse" known to torch.compile; idempotent.

    An installed tilefuse does it through its `torch_dynamo_backends` entry point (no import
    needed); from a source tree (PYTHONPATH) call this once. It never registers twice: dynamo
    refuses a second registration of a name whose entry point it loads later.
    """
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry

    if NAME in registry._COMPILER_FNS:
        return
    if NAME in entry_points(group="torch_dynamo_backends").names:
        return  # dynamo loads it on first lookup
    registry.register_backend(tilefuse_backend, name=NAME)


def _is_weight(node, value) -> bool:
    """A parameter or buffer that dynamo lifted to a graph input."""
    if isinstance(value, torch.nn.Parameter):
        return True
    source = getattr(node.meta.get("grapharg"), "source", None)
    text = repr(source) if source is not None else ""
    return "_buffers" in text or "_parameters" in text or "ParamBuffer" in text


def _few(names) -> str:
    """The first three names, and how many more (a 32-layer model has 32 of each)."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _distinct(tensors: list) -> list:
    """`tensors` with each repeat of one tensor object cloned. torch.export takes one object
    passed twice as one input, so a program compiled at a call where two ints shared a 0-d
    tensor (`_tensorized(share=True)`) would read one value for both at later calls where
    they differ."""
    seen: set = set()
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) in seen:
            t = t.clone()
        seen.add(id(t))
        out.append(t)
    return out


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter; identity is all we can check
        return -1


@dataclass
class _Variant:
    """One compiled program: for one set of sizes and one set of weight tensors."""

    program: object | None  # tilefuse Program, or None when this variant runs in eager
    weights: list  # weakrefs to the weight tensors it was compiled with
    versions: list[int]
    reason: str = ""
    # where each weight's data lay: `module.half(); module.float()` swaps a parameter's data
    # (same object, same version counter), so the values may have changed under the variant
    pointers: list = field(default_factory=list)
    # (output leaf, user input) pairs where the graph returns that input itself: the caller's
    # tensor is returned, as eager returns it (tilefuse's program gives a copy)
    identity: tuple = ()
    ints: dict = field(default_factory=dict)  # output position -> its integer value at these sizes
    resized: bool = False  # made from another size's program with no compile (runtime.resize)

    def fresh(self, weights) -> bool:
        # (every call checks every weight: list comprehensions compared whole, ~3x faster than one
        # generator over the four lists, for a decode step whose host time is its latency)
        if len(weights) != len(self.weights):
            return False
        try:
            versions = [w._version for w in weights]
        except RuntimeError:  # an inference tensor among them (no version counter)
            versions = [_version(w) for w in weights]
        return (versions == self.versions and [w.data_ptr() for w in weights] == self.pointers
                and all([r() is w for r, w in zip(self.weights, weights)]))

    def current(self) -> bool:
        """Its program runs, with the weights it was compiled with, unchanged."""
        return self.program is not None and not self.dead() and self.fresh([r() for r in self.weights])

    def dead(self) -> bool:
        """A weight it was compiled with is gone: no call can use it again."""
        return any(r() is None for r in self.weights)


class _Lifted(torch.nn.Module):
    """The GraphModule with its lifted weights put back as buffers (Graph IR Weights, named
    w0, w1, ...), so torch.export sees only the user's tensors as inputs. Its sizes are
    either fixed ints or (input, dim) read from a user tensor, which keeps them symbolic."""

    capture_name = "the graph"  # (what capture's errors call it)

    def __init__(self, gm, kinds, ints, weights, drop=frozenset()):
        super().__init__()
        self.gm = gm
        self.kinds = kinds
        self.ints = ints
        self.drop = drop  # output positions that are sizes (GraphRunner.int_outputs), not tensors
        for i, w in enumerate(weights):
            self.register_buffer(f"w{i}", w.detach())

    def forward(self, *inputs):
        ints = iter(inputs[s[0]].shape[s[1]] if isinstance(s, tuple) else s for s in self.ints)
        users, weights = iter(inputs), iter(self.buffers(recurse=False))
        args = [next(ints) if k == "int" else next(weights) if k == "weight" else next(users) for k in self.kinds]
        out = self.gm(*args)
        return tuple(o for j, o in enumerate(out) if j not in self.drop) if self.drop else out


def _size_sources(placeholders, kinds) -> tuple[list, list] | None:
    """For a graph with SymInt inputs: the (user input, dim) each SymInt is a size of, and each
    user input's dynamic dims for torch.export; None where a SymInt is no tensor's dim (a
    Python number dynamo made dynamic)."""
    from torch.export import Dim

    where, dims = {}, []
    for node, kind in zip(placeholders, kinds):
        if kind != "input":
            continue
        val = node.meta.get("example_value")
        if not isinstance(val, torch.Tensor):
            return None
        dims.append({})
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt):
                dims[-1][d] = Dim.AUTO
                where.setdefault(size.node.expr, (len(dims) - 1, d))
    sources = []
    for node, kind in zip(placeholders, kinds):
        if kind == "int":
            val = node.meta.get("example_value")
            src = where.get(val.node.expr) if isinstance(val, torch.SymInt) else None
            if src is None:
                return None
            sources.append(src)
    return sources, dims


def _int_outputs(gm) -> dict:
    """Output position -> the size expression (sympy, or an int) of each output that is an
    integer, not a tensor (transformers' sliding-window cache returns its length): tilefuse's
    program returns tensors, and these are evaluated from the call's sizes instead. Empty when
    there are none, or when an output is some other non-tensor (capture then says so)."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not isinstance(out, (tuple, list)):
        return {}
    found = {}
    for j, o in enumerate(out):
        val = o.meta.get("example_value") if isinstance(o, torch.fx.Node) else o
        if isinstance(val, torch.SymInt):
            found[j] = val.node.expr
        elif type(val) is int:
            found[j] = val
        elif not isinstance(val, torch.Tensor):
            return {}
    return found if len(found) < len(out) else {}


def _value_ints(placeholders, kinds, int_outputs) -> dict:
    """The int inputs to pass as 0-d tensors (frontend.scalar_ints), position -> size symbol;
    none where the graph reads no tensor of the caller's (the program would not know its device)."""
    from .scalar_ints import value_ints

    if "input" not in kinds:
        return {}
    dims = {d.node.expr for node, kind in zip(placeholders, kinds) if kind == "input"
            for d in getattr(node.meta.get("example_value"), "shape", ()) if isinstance(d, torch.SymInt)}
    found = value_ints(placeholders, kinds, dims, frozenset(int_outputs))
    return {i: placeholders[i].meta["example_value"].node.expr for i in found}


def _int_evaluator(int_outputs: dict, gm, kinds, scalars):
    """A function of a call's arguments (as dynamo passes them) giving the integer outputs
    ({position: value}), made once: `_int_values` through sympy took ~0.2 ms a decode step of a
    4-layer Mistral, a fifth of its host time. None where an output is not a polynomial with
    integer coefficients in sizes the arguments give directly (an int input or a tensor's dim)."""
    import sympy

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    where = {}  # size symbol -> (argument position, dim or None)
    for i, (node, kind) in enumerate(zip(placeholders, kinds)):
        val = node.meta.get("example_value")
        if isinstance(val, torch.SymInt) and (kind == "int" or i in scalars):
            where.setdefault(val.node.expr, (i, None))
        elif kind == "input" and isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt):
                    where.setdefault(size.node.expr, (i, d))

    def simple(e) -> bool:
        if isinstance(e, (sympy.Integer, sympy.Symbol)):
            return isinstance(e, sympy.Integer) or e in where
        if isinstance(e, sympy.Pow):
            return simple(e.base) and isinstance(e.exp, sympy.Integer) and e.exp >= 0
        return isinstance(e, (sympy.Add, sympy.Mul)) and all(simple(a) for a in e.args)

    exprs = {j: sympy.sympify(e) for j, e in int_outputs.items()}
    if not all(simple(e) for e in exprs.values()):
        return None
    symbols = sorted({x for e in exprs.values() for x in e.free_symbols}, key=str)
    names = [f"a{k}" for k in range(len(symbols))]
    body = ", ".join(f"{j}: int({sympy.sstr(e.xreplace(dict(zip(symbols, map(sympy.Symbol, names)))))})"
                     for j, e in exprs.items())
    fn = eval(f"lambda {', '.join(names)}: {{{body}}}", {})  # (sympy's text of +, *, ** and integers)
    getters = [where[x] for x in symbols]
    return lambda args: fn(*(int(args[i]) if d is None else args[i].shape[d] for i, d in getters))


def _size_values(placeholders, kinds, ints, user) -> dict:
    """Each size symbol of the graph -> its value in this call (from the int arguments and the
    user tensors' shapes)."""
    values, ints, user = {}, iter(ints), iter(user)
    for node, kind in zip(placeholders, kinds):
        val = node.meta.get("example_value")
        if kind == "int":
            arg = next(ints)
            if isinstance(val, torch.SymInt):
                values[val.node.expr] = int(arg)
        elif kind == "input":
            t = next(user)
            for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
                if isinstance(size, torch.SymInt):
                    values[size.node.expr] = t.shape[d]
    return values


def _with_ints(out, ints: dict):
    """The program's tensor outputs with the integer outputs put back at their positions."""
    leaves = list(out)
    for j in sorted(ints):
        leaves.insert(j, ints[j])
    return tuple(leaves)


class GraphRunner:
    """What the backend returns for one dynamo graph."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, arch: str | None = None):
        self.gm = self.eager = gm  # (gm: what compiles; eager: what runs where it does not, the graph as given)
        self.arch = arch
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.kinds = []
        self._kind_positions = None  # (kinds, positions of ints, inputs, weights): `_positions`
        for node, value in zip(placeholders, example_inputs):
            if not isinstance(value, torch.Tensor):
                self.kinds.append("int")
            else:
                self.kinds.append("weight" if _is_weight(node, value) else "input")
        self.int_outputs = _int_outputs(gm)
        self.scalar_values: dict = {}  # the call in hand's values of those ints: size symbol -> int
        # ints passed to the program as 0-d tensors (frontend.scalar_ints): position -> its size symbol
        self.scalars = _value_ints(placeholders, self.kinds, self.int_outputs) if "int" in self.kinds and \
            len(placeholders) == len(example_inputs) else {}
        if self.scalars:
            from .scalar_ints import tensorize

            self.gm = tensorize(gm, self.scalars)
            placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
            for i in self.scalars:
                self.kinds[i] = "input"
            # (no int() of dynamo's SymInts here: it would guard the graph on their values)
            example_inputs = self._tensorized([0 if i in self.scalars else a for i, a in enumerate(example_inputs)])
        fx_ops = sum(n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes)
        self.report = GraphReport(len(REPORTS), fx_ops, runner=weakref.ref(self))
        REPORTS.append(self.report)
        self.stages = None  # the last compiled variant's tilefuse.compiler.Compiled (GraphReport.stages)
        self.variants: dict = {}
        self.refusals: Counter = Counter()  # failure reason -> sizes it failed at
        self.refused = ""  # a reason met at REFUSED_AFTER sizes: new sizes run in eager, untried
        self.symbolic = None  # frontend.sizes.Symbolic: one export serving every size, once made
        # (runtime.resize.Family, its variant, its weights' ids): where two sizes' programs are one
        # program but for shapes only externs see, later sizes are made from it with no compile
        self.family = None
        self.last_compiled = None  # (key, variant) of the last size compiled in full
        self.in_torch = frozenset()  # small maps over varying shapes run in PyTorch (runtime.resize.torch_maps)
        self.sources = _size_sources(placeholders, self.kinds) if "int" in self.kinds else None
        self.placeholders = placeholders
        self.int_now = None  # the integer outputs from a call's arguments, per call (_int_evaluator), once made
        self.host_scalars: tuple = ()  # user inputs that are 0-d CPU tensors beside CUDA ones
        self.fallback = self._why_eager(example_inputs, placeholders)
        self.prologue = None  # tensors made from sizes alone, in PyTorch before each call (size_prologue)
        self.prologue_reads = None  # the placeholders it reads, where its results may be reused
        self.prologue_made: dict = {}  # sizes -> (its results, their bytes), oldest first, at most PROLOGUE_BYTES
        self.prologue_bytes = 0
        if "int" in self.kinds and not self.fallback:
            self._split_prologue()
            placeholders = self.placeholders
        if self.scalars and not self.fallback:
            names = _few([placeholders[i].name for i in self.scalars])
            self._event(f"int input(s) {names} only enter tensor arithmetic: passed as 0-d tensors, so one "
                        f"program serves every value")
        if self.fallback:
            self.report.status, self.report.reason = "eager", self.fallback
            _log(self.report.line())
            if self.fallback is _TRAINING:
                _warn_training(self.fallback)
        elif "int" in self.kinds or self.scalars:  # (compiled at the first call, which gives their values)
            self.report.reason = "dynamic sizes are specialised"
            _log(self.report.line())
            if self.sources is None and "int" in self.kinds:
                self._event("each size is exported on its own: a size input is no tensor's dim (a Python int "
                            "dynamo made dynamic), which one symbolic export cannot take")
        else:
            self._variant(example_inputs)  # compile now: errors and the summary show at compile time

    def _split_prologue(self) -> None:
        """Tensors the graph builds from its sizes alone (a decode step's causal mask under torch
        2.11: `arange(s0 + 1)`, ...) are made in PyTorch before each call and passed to the program
        as inputs, so no op of the program takes a size as an argument (frontend.size_prologue)."""
        from .size_prologue import split

        try:
            sp = split(self.gm, self.kinds)
        except Exception as e:  # noqa: BLE001 - the graph as it is still compiles, per size
            self._event(f"tensors made from sizes stay in the program ({_first_line(e)})")
            return
        if sp is None:
            return
        self.prologue, self.gm = sp.prologue, sp.main
        self.prologue_reads = sp.reads if sp.reusable else None
        self.kinds = self.kinds + ["input"] * len(sp.names)
        self.placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.sources = _size_sources(self.placeholders, self.kinds)
        self._event(f"{_few(sp.names)}: made from sizes alone, in PyTorch before each call, so the program takes no size "
                    f"as an argument")

    def _made_from_sizes(self, args, given=None) -> list:
        """The prologue's tensors for this call: contiguous (a strided one's strides would be
        sizes of their own to torch.export, which no input binds), and a 0-d one on the CPU
        beside CUDA inputs (`torch.tensor(s0)`, a number to eager) on their GPU. They depend on
        the sizes alone, so they are made once per sizes and kept (a decode step's ~15 small ops
        and their launches, each token); the program never writes them (written ones stay in it)
        and never returns them (`Split.reusable`). `given`: the call's arguments before int
        scalars became tensors (their values, not their shapes, are the key)."""
        key = None
        if self.prologue_reads is not None:
            given = args if given is None else given
            key = tuple((tuple(args[i].shape), args[i].stride(), args[i].device)
                        if isinstance(given[i], torch.Tensor) else given[i] for i in self.prologue_reads)
            kept = self.prologue_made.get(key)
            if kept is not None:
                return kept[0]
        made = [t.contiguous() for t in self.prologue(*args)]
        if any(t.device.type == "cpu" and t.dim() == 0 for t in made):
            cuda = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
            if cuda is not None:
                made = [t.to(cuda) if t.device.type == "cpu" and t.dim() == 0 else t for t in made]
        nbytes = sum(t.untyped_storage().nbytes() for t in made) if key is not None else 0
        if key is not None and nbytes <= PROLOGUE_BYTES:
            while self.prologue_made and (len(self.prologue_made) >= MAX_MADE + MAX_VARIANTS
                                          or self.prologue_bytes + nbytes > PROLOGUE_BYTES):
                self.prologue_bytes -= self.prologue_made.pop(next(iter(self.prologue_made)))[1]  # (the oldest)
            self.prologue_made[key] = (made, nbytes)
            self.prologue_bytes += nbytes
        return made

    def _why_eager(self, example_inputs, placeholders) -> str:
        if len(placeholders) != len(example_inputs):
            return f"dynamo gave {len(example_inputs)} inputs for {len(placeholders)} placeholders"
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return _TRAINING
        if any(n.target is torch.amp.autocast_mode._enter_autocast for n in self.gm.graph.nodes):
            return ("it enters torch.autocast, whose casts torch.export does not record (cast the model "
                    "instead: model.to(torch.bfloat16))")
        if any(t.is_sparse or t.is_quantized or t.is_nested for t in tensors):
            return "sparse, quantized or nested tensor inputs"
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            # a 0-d CPU tensor beside CUDA tensors (transformers' static cache counts its length in
            # one until the first step moves it) is moved to the GPU for each call
            cuda = {d for d in devices if d.type == "cuda"}
            scalars = [i for i, t in enumerate(x for x, k in zip(example_inputs, self.kinds) if k == "input")
                       if t.device.type == "cpu" and t.dim() == 0]
            on_cpu = [t for t in tensors if t.device.type == "cpu"]
            if len(cuda) != 1 or len(on_cpu) != len(scalars) or len(devices) != 2:
                return f"inputs on several devices: {sorted({str(t.device) for t in tensors})}"
            out = [n for n in self.eager.graph.nodes if n.op == "output"]  # (as given: its int outputs are ints)
            vals = [a.meta.get("example_value") for a in torch.utils._pytree.tree_leaves(out[0].args)
                    if isinstance(a, torch.fx.Node)] if out else []
            if any(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in vals):
                return "inputs on several devices, and an output on the CPU (tilefuse runs a program on one device)"
            self.host_scalars = tuple(scalars)
        if "input" not in self.kinds:  # a program of weights alone would not know its device
            return "the graph reads no tensors of the caller's, only weights and sizes"
        return ""

    # -- calling ---------------------------------------------------------------------------------
    def __call__(self, *args):
        if self.fallback:
            self.report.calls_eager += 1
            return self.eager(*args)
        given_args = args
        if self.scalars:
            self.scalar_values = {self.scalars[i]: int(args[i]) for i in self.scalars}
            args = self._tensorized(args, share=True)
        if self.prologue is not None:
            args = (*args, *self._made_from_sizes(args, given_args))
        v = self._variant(args)
        if v.program is None:
            self.report.calls_eager += 1
            return self.eager(*given_args)
        user = [args[i] for i in self._positions()[1]]
        g = v.program.graph
        given = user
        if self.host_scalars:
            device = next(t.device for t in user if t.device.type == "cuda")
            given = list(user)
            for i in self.host_scalars:
                given[i] = user[i].to(device)
        try:
            out = v.program(*given)
        except OverlappingWrites as e:  # (eager's writes reach the other views; the graph reads them unchanged)
            self._event(f"a call ran in eager: {e}", once=True)
            self.report.calls_eager += 1
            return self.eager(*given_args)
        except Exception as e:  # a kernel that fails to build or launch: eager from now on, said once
            v.program, v.reason = None, f"runtime error, now in eager: {_first_line(e)}"
            self._event(v.reason)
            if g.writes:  # it may have written some of its inputs already: running eager would write them again
                raise RuntimeError(f"tilefuse: graph {self.report.index} failed while it may have written its "
                                   f"inputs in place ({_first_line(e)}); later calls run in eager") from e
            self.report.calls_eager += 1
            return self.eager(*given_args)
        self.report.calls_tilefuse += 1
        for i in self.host_scalars:
            if g.inputs[i] in g.writes:
                user[i].copy_(given[i])
        if v.identity:
            leaves, spec = torch.utils._pytree.tree_flatten(out)
            for j, i in v.identity:
                leaves[j] = user[i]
            out = torch.utils._pytree.tree_unflatten(leaves, spec)
        if v.ints and self.scalars:  # (they follow the values, which one variant serves all of)
            if self.int_now is None:
                self.int_now = _int_evaluator(self.int_outputs, self.eager, self.kinds, self.scalars) or False
            ints = self.int_now(given_args) if self.int_now else \
                self._int_values([a for a, k in zip(args, self.kinds) if k == "int"], user)
            return _with_ints(out, ints)
        return _with_ints(out, v.ints) if v.ints else out

    def _tensorized(self, args, share: bool = False) -> list:
        """`args` with the ints at `self.scalars` as 0-d int64 tensors, on the GPU where a user
        tensor is (made by a fill, not copied from the host: no synchronisation). `share`: one
        tensor for each distinct value (a cache's layers pass one length: a 16-layer decode step
        made 16 fills); `_compile` gives torch.export distinct tensors (`_distinct`)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]  # (weights too: a graph may read no other)
        device = next((t.device for t in tensors if t.is_cuda), tensors[0].device if tensors else "cpu")
        made: dict = {}

        def fill(a):
            v = int(a)
            t = made.get(v) if share else None
            if t is None:
                t = made[v] = torch.full((), v, dtype=torch.int64, device=device)
            return t

        return [fill(a) if i in self.scalars else a for i, a in enumerate(args)]

    def _positions(self) -> tuple:
        """Where the ints, inputs and weights are among the call's arguments (kept until `kinds` is
        replaced, as set-up does)."""
        if self._kind_positions is None or self._kind_positions[0] is not self.kinds:
            at = {k: [i for i, x in enumerate(self.kinds) if x == k] for k in ("int", "input", "weight")}
            self._kind_positions = (self.kinds, at["int"], at["input"], at["weight"])
        return self._kind_positions[1:]

    def _key(self, args):
        ints_at, inputs_at, weights_at = self._positions()
        ints = tuple([int(args[i]) if isinstance(args[i], (int, torch.SymInt)) else args[i] for i in ints_at])
        shapes = tuple([tuple(args[i].shape) for i in inputs_at])
        wids = tuple([id(args[i]) for i in weights_at])
        return ints, shapes, wids

    def _variant(self, args) -> _Variant:
        weights = [args[i] for i in self._positions()[2]]
        key = self._key(args)
        v = self.variants.get(key)
        if v is not None and (v.fresh(weights) or (v.program is None and not v.dead())):
            return v  # a refused graph stays in eager: its own run moves a buffer's version (BatchNorm)
        if v is not None and not v.dead():
            self._event("a weight changed in place since compiling: compiling again", once=True)
            self._drop_stale()
        self.variants = {k: x for k, x in self.variants.items() if not x.dead()}  # models since freed
        if self.refused:  # (each try of a refused graph cost an export, ~0.5 s a size of a small model)
            return _Variant(None, [], [], self.refused)
        # Sizes made with no compile have a limit of their own, far above compiled ones': a made
        # size shares its family's kernels and weights, and its CUDA graphs come out of the
        # process's graph memory limit (runtime.graphs.GraphMemory). None is ever dropped to make
        # room: making one again (and its first, uncaptured call) cost more than eager's step.
        made = sum(x.resized for x in self.variants.values())
        v = self._resized(args, weights, key, full=made >= MAX_MADE)
        if v is None:
            if len(self.variants) - made >= MAX_VARIANTS:
                return self._over(f"more than {MAX_VARIANTS} compiled sizes or weight sets: new ones run in eager")
            v = self._compile(args, weights)
            self._relate(key, v)
        elif v.program is None:
            return v  # (a size the family would make, past MAX_MADE: not kept, so not counted)
        self.variants[key] = v
        return v

    def _drop_stale(self) -> None:
        """Drop every program whose weights changed in place since it was compiled (the sizes
        made from one share its weight list: checked once per list)."""
        current: dict = {}

        def keep(x) -> bool:
            if x.program is None:
                return True
            if id(x.weights) not in current:
                current[id(x.weights)] = x.current()
            return current[id(x.weights)]

        self.variants = {k: x for k, x in self.variants.items() if keep(x)}

    def _over(self, reason: str) -> _Variant:
        """An eager variant for a call past a limit, said once."""
        self._event(reason, once=True)
        return _Variant(None, [], [], reason)

    def _resized(self, args, weights, key, full: bool = False) -> _Variant | None:
        """This size made from the family's program with no compile (runtime.resize), or None
        where it cannot be: other weights, or sizes the symbolic export does not hold for.
        `full`: MAX_MADE sizes are made already; one the family would make runs in eager (a
        compile instead would cost each of them ~1 s, up to MAX_VARIANTS of them)."""
        if self.family is None:
            return None
        fam, base, wids = self.family
        if key[2] != wids or base.program is None:
            return None
        if not base.fresh(weights):
            # its weights were updated in place: the family and every program of the old values
            # go (left counted, the sizes made from them would keep new sizes from being made)
            self.family = None
            self._drop_stale()
            return None
        user = [a for a, k in zip(args, self.kinds) if k == "input"]
        if self.symbolic.bind(user) is None:
            return None
        if full:
            return self._over(f"more than {MAX_MADE} sizes made with no compile: new ones run in eager")
        prog = fam.at([tuple(t.shape) for t in user])
        if prog is None:
            return None
        try:
            out_ints = self._int_values([a for a, k in zip(args, self.kinds) if k == "int"], user)
        except _Unsupported:
            return None
        self.report.variants += 1
        self.report.resized += 1
        return _Variant(prog, base.weights, base.versions, pointers=base.pointers, identity=base.identity,
                        ints=out_ints, resized=True)

    def _relate(self, key, v: _Variant) -> None:
        """After a size compiled in full: where its program and the last compiled size's are one
        program but for shapes that only extern ops see, sizes to come are made from it."""
        from ..runtime import resize

        last, self.last_compiled = self.last_compiled, (key, v)
        if self.family is not None and self.family[1].current():
            return  # the family in use still holds
        sym = self.symbolic
        if (v.program is None or last is None or last[1].program is None or sym is None or sym.why_not
                or last[0][2] != key[2] or last[0][:2] == key[:2]):
            return  # (two sizes of one weight set: not a recompile after an in-place update)
        fam = (f"an op takes a size as an argument ({sym.sized_op})" if sym.sized_op else
               f"a size is a piecewise function of the sizes ({sym.piecewise}), which two sizes cannot show"
               if sym.piecewise else resize.family(last[1].program, v.program))
        if isinstance(fam, str):
            maps = (resize.torch_maps(last[1].program, v.program)
                    if not self.in_torch and not sym.sized_op and not sym.piecewise else None)
            if maps:  # (the next two sizes compile with them in PyTorch, then make a family)
                self.in_torch, self.last_compiled = maps, None
                self._event(f"{fam}: that map ({', '.join(sorted(maps))}) runs in PyTorch from the next size on, "
                            f"so that later sizes can be made with no compile", once=True)
                return
            self._event(f"each size compiles on its own: {fam}", once=True)
            return
        self.family = (fam, v, key[2])
        self._event("new sizes are made from this size's program with no compile (only extern ops see "
                    "the sizes change)", once=True)

    def _compile(self, args, weights) -> _Variant:
        from ..compiler import compile_stages

        refs, versions = [weakref.ref(w) for w in weights], [_version(w) for w in weights]
        pointers = [w.data_ptr() for w in weights]
        if -1 in versions and not self.report.inference_weights:
            self.report.inference_weights = True
            self._event("its weights are inference tensors (made under torch.inference_mode()), which keep no "
                        "version counter: an in-place update of them is not seen; after one, call "
                        "torch._dynamo.reset() and compile again")
        ints = [a for a, k in zip(args, self.kinds) if k == "int"]
        user = _distinct([a for a, k in zip(args, self.kinds) if k == "input"])
        t0 = time.perf_counter()
        try:
            out_ints = self._int_values(ints, user)
            live = storages(weights)  # (derived weights some program holds: not twice; parameters: never pooled)
            with torch.no_grad(), interning(lambda t: POOL.intern(t, live)):
                exported = self._instance(user, weights)
                self.report.exports += exported is None
                c = compile_stages(_Lifted(self.gm, self.kinds, ints, weights, frozenset(self.int_outputs)), tuple(user),
                                   arch=self.arch, exported=exported, in_torch=self.in_torch)
            prog = c.program
            n_out = prog.out_spec.num_leaves if prog.out_spec is not None else len(c.graph.results)
            if n_out != len(c.graph.results):
                raise _Unsupported(f"the program returns {len(c.graph.results)} tensors where the graph returns {n_out}")
            # (the graph as captured too: a transposed view of an input, returned, becomes a
            # kernel's copy in the rewrites, and code after a graph break may write through it)
            aliased = _aliased_output(c.captured) or _aliased_output(c.graph)
            if aliased:
                raise _Unsupported(aliased)
            POOL.share(prog.graph.weights, live=weights)  # equal derived weights, held once by every size's program
            prog.pool = POOL
            if any(t.is_cuda for t in user):
                prog.prepare("cuda")
                if c.graph.writes:  # what can fail before a call writes anything fails here (see __call__)
                    prog.runner(next(t.device for t in user if t.is_cuda))
        except Exception as e:  # never a crash: the graph runs as its own forward, and says why
            reason = _first_line(e)
            self._event(f"eager fallback: {reason}", once=True)
            if not self.report.variants:
                self.report.status, self.report.reason = "eager", reason
            self.refusals[reason] += 1
            if self.refusals[reason] >= REFUSED_AFTER:
                self.refused = reason
                self._event(f"failed at {REFUSED_AFTER} sizes for the same reason: new sizes run in eager "
                            f"without compiling")
            return _Variant(None, refs, versions, reason, pointers)
        self._record(c, time.perf_counter() - t0)
        return _Variant(prog, refs, versions, pointers=pointers, identity=_identity_outputs(c.graph), ints=out_ints)

    def _int_values(self, ints, user) -> dict:
        """The integer outputs' values at this call's sizes (`_int_outputs`)."""
        import sympy

        if not self.int_outputs:
            return {}
        values = _size_values(self.placeholders, self.kinds, ints, user)
        if self.scalars:
            values.update(self.scalar_values)
        out = {}
        for j, expr in self.int_outputs.items():
            v = expr if isinstance(expr, int) else sympy.sympify(expr).xreplace(values)
            if not isinstance(v, int) and (v.free_symbols or not v.is_integer):
                raise _Unsupported(f"output {j} is a size tilefuse cannot evaluate from the inputs' sizes ({expr})")
            out[j] = int(v)
        return out

    def _instance(self, user, weights):
        """This size's aten graph from the graph's one symbolic export (made at the first
        size), or None: the caller exports this size on its own."""
        from .capture import export
        from .sizes import Symbolic

        if self.sources is None:
            return None
        if self.symbolic is None:
            sources, dims = self.sources
            try:
                ep = export(_Lifted(self.gm, self.kinds, sources, weights, frozenset(self.int_outputs)), tuple(user),
                            dynamic_shapes=(tuple(dims),))
                self.report.exports += 1
                self.symbolic = Symbolic(ep)
            except Exception as e:
                self.sources = None
                self._event(f"each size is exported on its own (a symbolic export failed: {_first_line(e)})")
                return None
            if self.symbolic.why_not:
                self._event(f"each size is exported on its own ({self.symbolic.why_not})")
                self.sources = None
                return None
        return self.symbolic.instance(user, {f"w{i}": w.detach() for i, w in enumerate(weights)})

    def _record(self, c, seconds: float) -> None:
        from ..graph import ir

        r = self.report
        r.status, r.reason, self.stages = "tilefuse", "", c
        r.variants += 1
        r.compile_s = seconds
        steps = c.plan.steps
        r.kernels = sum(s.family in ("mapreduce", "gemm") for s in steps)
        r.fused_ops = sum(len(s.nodes) for s in steps if s.family in ("mapreduce", "gemm"))
        r.aliases = sum(s.family == "alias" for s in steps)
        r.externs, r.views = Counter(), Counter()
        for s in steps:
            if s.family == "extern":
                n = c.graph[s.nodes[0]]
                what = n.target if isinstance(n, ir.Extern) else type(n).__name__.lower()
                if isinstance(n, ir.View):
                    what = f"{'' if s.view else 'view '}{n.op}"
                (r.views if s.view else r.externs)[(what, s.note)] += 1
        _log(r.line())

    def _event(self, text: str, once: bool = False) -> None:
        """`once`: recorded and logged once per graph (each new size failing the same way)."""
        line = f"graph {self.report.index}: {text}"
        if not (once and line in self.report.events):
            self.report.events.append(line)
            _log(line)


class _Unsupported(Exception):
    pass


def _identity_outputs(g) -> tuple:
    """(output index, input index) for each result that is an input itself (a no-op `.to`); not
    one the graph writes, whose result is its value as given (a copy)."""
    return tuple((j, g.inputs.index(o)) for j, o in enumerate(g.results) if o in g.inputs and o not in g.writes)


def _aliased_output(g) -> str:
    """Why an output must share memory with an input or another output, which tilefuse's fresh
    results do not: dynamo runs the code after a graph break on the graph's outputs, so an
    in-place write there through `x.t()`, `h[:, :2]` or `x.view(x.shape)` must reach x or h. ""
    if none must (a reshape of an input to another shape is returned as a view of it; an input
    itself is returned as the caller's tensor: `_identity_outputs`)."""
    from ..graph import ir

    outs = set(g.results)
    for o in g.results:
        n, ops = g[o], []
        while isinstance(n, ir.View):
            ops.append(n.op)
            n = g[n.arg]
        if (ops and n.name in outs) or (isinstance(n, ir.Input) and ops and set(ops) != {"reshape"}):
            what = "another output" if ops and n.name in outs else "an input"
            return (f"an output is a {ops[0]} view of {what}, which "
                    f"code after a graph break may write through; tilefuse returns fresh tensors")
    return ""


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
