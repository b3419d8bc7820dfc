"""Capture a PyTorch program with torch.export and translate its aten graph to Graph IR."""
from __future__ import annotations

import contextlib
import io
import logging
import operator
import re
import sys
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from .. import dtypes
from ..graph import ir
from ..graph.fold import RANDOM_WORDS
from . import aten
from .builder import Builder


class CaptureError(Exception):
    """A program tilefuse cannot take: says what and where, in one line."""


@dataclass(frozen=True)
class Out:
    """What torch.export says an op returns, handed to the translators."""

    shape: tuple[int, ...]
    dtype: str
    op: str
    target: str = ""  # the overload, "aten.sort.stable": for a translator that runs part of it in PyTorch


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)(?:\n(?!\s*File ")\s*(.*))?')


def source_of(node, expr: str | None = None) -> str:
    """The user's line that made an fx node: the innermost frame outside torch itself."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    user = [f for f in frames if "/torch/" not in f[0] and "/tilefuse/" not in f[0]]
    if not user:
        return expr or ""
    path, line, fn, text = user[-1]
    if path == "<tilefuse -c>" and expr:
        return f"-c {expr!r}"
    return f"{path}:{line} ({text.strip()})" if text.strip() else f"{path}:{line}"


def _as_module(fn) -> torch.nn.Module:
    if isinstance(fn, torch.nn.Module):
        return fn
    # torch.export records stack frames of `forward` methods only; anchoring the user's function
    # keeps its lines too, so errors and externs can name them (a no-op where torch lacks the hook).
    anchor = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)
    if anchor is not None:
        anchor(fn)

    class Wrapped(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    return Wrapped()


@contextlib.contextmanager
def _quiet(*names):
    """Silence loggers that print a traceback of their own for errors we report in one line."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export(fn, example_inputs, expr: str | None = None, dynamic_shapes=None):
    """torch.export the callable; errors become one clear CaptureError line."""
    ep, said = export_and_log(fn, example_inputs, expr, dynamic_shapes)
    sys.stderr.write(said)
    return ep


def export_and_log(fn, example_inputs, expr: str | None = None, dynamic_shapes=None):
    """`export`, and what torch.export wrote to stderr (its warnings), for the caller to show
    once the capture as a whole succeeded: a warning about a program then refused (an LSTM's
    flat weights "assigned during export") would precede the error that matters."""
    what = expr or getattr(fn, "capture_name", None) or (
        type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", "the program"))
    on = [d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
    if on:
        raise CaptureError(f"cannot capture {what} under torch.autocast ({on[0]}): torch.export does not record "
                           f"autocast's casts, so the program would not compute what autocast runs; cast the model "
                           f"and inputs instead (model.to(torch.bfloat16)), or compile outside autocast")
    module = _as_module(fn)
    said = io.StringIO()  # what export writes to stderr: shown where it succeeds, dropped where it fails
    try:
        # fake_tensor logs a traceback for a failed meta kernel; symbolic_shapes, for a symbolic
        # export (the backend's), a warning per unmatched symbol; a failed export prints its
        # partial graph (hundreds of lines for a model) and warnings that the one line replaces
        with _quiet("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes"), \
                contextlib.redirect_stderr(said):
            ep = torch.export.export(module, tuple(example_inputs), strict=False, dynamic_shapes=dynamic_shapes)
    except Exception as e:  # torch raises many kinds; the user needs the first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, IndexError) and _raised_in(e, "produce_guards_verbose"):
            # torch.export's guards index an input by its rank at the end of the trace: an
            # in-place op that changed it (x.unsqueeze_(0)) fails there with this bare IndexError
            first = ("an in-place op changes the number of dimensions of an input (unsqueeze_ or the like), "
                     "which torch.export cannot capture; reshape it out of place")
        if "for index, but got torch.uint8" in first:
            # eager takes uint8 class targets in cross_entropy / nll_loss, but export's trace of them
            # indexes with the targets, which must be int32/int64 there (as gather's index must be)
            first += " (an index, or class targets, of dtype uint8 cannot be captured: pass it as int64, .long())"
        raise CaptureError(f"torch.export could not capture {what}: {first}") from e
    return ep, said.getvalue()


def _raised_in(e: BaseException, function: str) -> bool:
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


def _meta(node) -> Out | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        name = node.target._schema.name.split("::")[-1] if hasattr(node.target, "_schema") else str(node.target)
        return Out(tuple(int(s) for s in val.shape), dtypes.from_torch(val.dtype), name)
    return None


def _op_name(target) -> str:
    if hasattr(target, "_schema"):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _target_text(target) -> str:
    if hasattr(target, "_schema"):
        ns, name = target._schema.name.split("::")
        return f"{ns}.{name}.{target._overloadname}"
    return str(target)


def to_graph(ep, expr: str | None = None) -> ir.Graph:
    """Translate an ExportedProgram's graph into Graph IR."""
    b = Builder()
    sig = {s.arg.name: s for s in ep.graph_signature.input_specs}
    env: dict = {}
    weights: dict = {}
    inputs: list[str] = []
    tuple_outputs: dict = {}
    outputs: list[str] = []
    layouts: list = []  # per result: eager_layout of its value
    state = dict(ep.state_dict)
    state.update(getattr(ep, "constants", {}) or {})
    user_inputs = {n for n in ep.graph.nodes if n.op == "placeholder" and sig[n.name].kind.name == "USER_INPUT"}
    owned = owned_tensors(ep.graph, user_inputs)
    # a weight's or buffer's placeholder -> what it is in the module ("buffer bn.num_batches_tracked")
    state_of = {n: f"{sig[n.name].kind.name.lower()} {sig[n.name].target}" for n in ep.graph.nodes
                if n.op == "placeholder" and sig[n.name].kind.name in ("PARAMETER", "BUFFER")
                and sig[n.name].target}
    updated: dict = {}  # input placeholder -> its value after the program's in-place writes
    given: dict = {}  # input placeholder -> its Input's name

    def resolve(a):
        if isinstance(a, torch.fx.Node):
            if a in tuple_outputs:
                raise CaptureError(f"{_op_name(a.target)} returns several tensors; only its first is supported "
                                   f"({source_of(a, expr)})")
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(resolve(x) for x in a)
        if isinstance(a, torch.dtype):
            return a
        return a

    def call(node):
        if node.target is operator.getitem:
            src, idx = node.args
            outs = tuple_outputs.get(src)
            if isinstance(outs, tuple) and outs[idx] is not None:
                # every output was translated (split, chunk, unbind, a region, an extern's results)
                env[node] = outs[idx]
                return
            if outs is not None and not isinstance(outs, tuple) and idx == 0:
                env[node] = outs
                return
            if not node.users:  # (torch.export names every result, read or not)
                return
            raise CaptureError(f"output {idx} of {_op_name(src.target)} is not supported "
                               f"({source_of(src, expr)})")
        region = _region(node)
        if region is not None:
            tuple_outputs[node] = inline(*region)
            env[node] = tuple_outputs[node][0]
            return
        composite = _decomposition(node)
        if composite is not None:
            outs = inline(*composite, source=b.source)
            vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else (node.meta["val"],)
            if [b.type(o).shape for o in outs] != [_static_shape(v, _op_name(node.target), b.source) for v in vals]:
                raise CaptureError(f"internal: aten.{_op_name(node.target)}'s decomposition gives shapes "
                                   f"{[b.type(o).shape for o in outs]} ({b.source})")
            if isinstance(node.meta["val"], (tuple, list)):
                tuple_outputs[node] = outs
            env[node] = outs[0]
            return
        try:
            if _mutates(node.target) and _op_name(node.target) != "detach_":
                _translate_in_place(b, node, resolve, env, expr, owned, updated, state_of)
            else:
                _translate(b, node, resolve, env, tuple_outputs, expr)
        except ValueError as e:  # an unsupported dtype, shapes that do not broadcast...
            raise CaptureError(f"aten.{_op_name(node.target)}: {e} ({b.source})") from e

    def inline(sub, operands, source=None) -> tuple:
        """Translate a region's subgraph in place, its placeholders bound to the call's operands;
        `source`: the line its every op is from (a decomposition's ops carry no trace of their own)."""
        values = iter(operands)
        result = ()
        for n in sub.graph.nodes:
            b.source = source if source is not None else source_of(n, expr) if n.op == "call_function" else ""
            if n.op == "placeholder":
                env[n] = resolve(next(values))
            elif n.op == "get_attr":
                env[n] = getattr(sub, n.target)
            elif n.op == "call_function":
                call(n)
            elif n.op == "output":
                result = tuple(env[o] for o in n.args[0])
        return result

    def _region(node):
        """(subgraph, operands) of a higher-order op that only scopes a region: grad mode (no
        effect here, nothing is differentiated) or a disabled autocast; None for any other op."""
        name = getattr(node.target, "__name__", "") or str(node.target)
        if name == "wrap_with_set_grad_enabled":
            return env[node.args[1]], node.args[2:]
        if name == "wrap_with_autocast":
            if node.args[2]:
                raise CaptureError(f"an autocast region ({source_of(node, expr)}): tilefuse compiles the dtypes "
                                   f"the program states; cast explicitly instead")
            return env[node.args[4]], node.args[5:]
        return None

    for node in ep.graph.nodes:
        b.source = source_of(node, expr) if node.op == "call_function" else ""
        if node.op == "placeholder":
            val = node.meta["val"]
            if not isinstance(val, torch.Tensor):
                kind = type(val).__name__
                raise CaptureError(f"input {node.name} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a tensor "
                                   f"(tilefuse.compile takes tensors, or lists, tuples and dicts of them)")
            try:
                t = ir.TensorType(tuple(int(s) for s in val.shape), dtypes.from_torch(val.dtype))
            except ValueError as e:
                raise CaptureError(f"input {node.name}: {e}") from e
            spec = sig[node.name]
            name = b.fresh(node.name)
            if spec.kind.name == "USER_INPUT":
                b.add(ir.Input(name, t))
                inputs.append(name)
                given[node] = name
            else:
                target = spec.target
                weights[name] = state[target].detach()
                b.add(ir.Weight(name, t, source=target))
            env[node] = name
        elif node.op == "call_function":
            call(node)
        elif node.op == "get_attr":
            env[node] = getattr(ep.graph_module, node.target)
        elif node.op == "output":
            for o in node.args[0]:
                if o is None or not isinstance(o, torch.fx.Node):
                    raise CaptureError("the program must return tensors (or a tuple of tensors)")
                outputs.append(env[o])  # (an input's name: the input as given; its update is a write)
                layouts.append(eager_layout(o.meta.get("val")))
        else:
            raise CaptureError(f"unexpected fx node {node.op} {node.target}")
    writes = tuple(given[p] for p in updated)
    outputs += [updated[p] for p in updated]
    used = _live(b.nodes, outputs)
    nodes = tuple(n for n in b.nodes if n.name in used or isinstance(n, ir.Input))
    return ir.Graph(nodes, tuple(inputs), tuple(outputs), {k: v for k, v in weights.items() if k in used}, writes,
                    tuple(layouts) if any(layouts) else ())


def eager_layout(val) -> tuple[int, ...] | None:
    """The order of `val`'s dims in memory (outermost first) where PyTorch lays it out densely
    but permuted: `x.transpose(1, 2) * c` keeps x's strides (its last dim innermost or not: a
    kernel computing it in that order reads x in its own, codegen/tiles.py where it must
    transpose). None for a contiguous tensor (size-1 dims in any place), for any other layout
    (overlapping, with gaps) and for symbolic sizes: those results are returned contiguous."""
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    try:
        shape, strides = [int(d) for d in val.shape], [int(d) for d in val.stride()]
    except (TypeError, ValueError, RuntimeError):  # (a SymInt with no value)
        return None
    real = [d for d in range(len(shape)) if shape[d] != 1]
    order = sorted(real, key=lambda d: -strides[d])
    if order == real or not real:
        return None
    expect = 1
    for d in reversed(order):  # dense: each dim's stride the product of the sizes inside it
        if strides[d] != expect:
            return None
        expect *= shape[d]
    slots = iter(order)  # size-1 dims keep their places; the others fill theirs in memory order
    return tuple(d if shape[d] == 1 else next(slots) for d in range(len(shape)))


def _decomposition(node):
    """(graph, operands) of the aten ops a CompositeImplicitAutograd op stands for, where tilefuse
    has no translator of its own for it: torch.export keeps such ops whole (`.T` is aten.numpy_T,
    `reshape_as`, `F.pad`, `torch.inner`...), and each is a few ops tilefuse lowers. Traced on meta
    tensors of the operands' shapes. None where the op has a translator or no such decomposition,
    or where the decomposition writes in place or reaches an op tilefuse does not lower (the op
    then stays one visible extern, named as the user wrote it)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or _op_name(target) in aten.HANDLERS or _mutates(target):
        return None
    if not torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
        return None
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    at = [i for i, a in enumerate(leaves) if isinstance(a, torch.fx.Node)]
    metas = []
    for i in at:
        v = leaves[i].meta.get("val")
        if not isinstance(v, torch.Tensor):
            return None  # a symbolic size, an opaque object
        try:
            metas.append(torch.empty_strided([int(d) for d in v.shape], [int(d) for d in v.stride()],
                                             dtype=v.dtype, device="meta"))
        except Exception:  # a data-dependent size
            return None

    def run(*tensors):
        filled = list(leaves)
        for i, t in zip(at, tensors):
            filled[i] = t
        args, kwargs = pytree.tree_unflatten(filled, spec)
        out = target(*args, **kwargs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    try:
        from torch.fx.experimental.proxy_tensor import make_fx
        gm = make_fx(run)(*metas)
    except Exception:  # a decomposition that reads values (one_hot's class count) or refuses meta
        return None
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem and (
                _op_name(n.target) not in aten.HANDLERS or _mutates(n.target)):
            return None
        if n.op == "output" and not all(isinstance(o, torch.fx.Node) for o in n.args[0]):
            return None
    return gm, [leaves[i] for i in at]


def _live(nodes, outputs) -> set[str]:
    by_name = {n.name: n for n in nodes}
    live, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        stack.extend(ir.node_args(by_name[n]))
    return live


def _mutates(target) -> bool:
    """An aten op that writes one of its arguments (add_, copy_, index_put_, ...)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write
                                      for a in schema.arguments)


def _written(node) -> list:
    """The arguments an aten op writes in place (`self` of add_, relu_, ...; `out=`)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    found = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(a.name)
            found.append(v)
    return found


def _returns_alias(target) -> bool:
    """Does an op's result (maybe) share its input's memory: a view, or `to`/`contiguous`,
    which return their input itself when there is nothing to do."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _converts(n) -> bool:
    """A `to` that changes the dtype or device: it returns new memory, never its input."""
    if _op_name(n.target) != "to" or not n.args or not isinstance(n.args[0], torch.fx.Node):
        return False
    a, r = n.args[0].meta.get("val"), n.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(r, torch.Tensor) and (a.dtype, a.device) != (r.dtype, r.device)


def _argument(n, name: str, default=None):
    """Argument `name` of an aten node, passed by position or by keyword."""
    if name in n.kwargs:
        return n.kwargs[name]
    for i, a in enumerate(n.target._schema.arguments):
        if a.name == name:
            return n.args[i] if i < len(n.args) and not a.kwarg_only else default
    return default


def _same_tensor(n) -> bool:
    """A `to` that changes nothing: it returns its input itself (`cache.to(device)`); not one
    with copy=True or another memory format, which make new memory."""
    return (_op_name(n.target) == "to" and hasattr(n.target, "_schema") and not _converts(n)
            and not _argument(n, "copy", False) and _argument(n, "memory_format") in (None, torch.preserve_format)
            and bool(n.args) and isinstance(n.args[0], torch.fx.Node))


def owned_tensors(graph, inputs=frozenset()) -> dict:
    """fx node -> the node that made its memory, for the tensors a program makes itself, and for
    each in-place write to one made before any view of it was taken (nor `contiguous`, which
    may return the same memory; a `to` that changes nothing is the tensor itself): such a write
    (`nn.ReLU(inplace=True)`, `y += 1`) is an update of that tensor's value and nothing else, so
    it can run out of place. A view taken after the last write is harmless (`relu_` then
    `.view(B, -1)`). The user's input placeholders named in `inputs` are roots too, mapped to
    themselves: a write to one is an update the program makes and then copies into the
    caller's tensor (a static KV cache's `index_copy_`). Weights, buffers, views, and tensors
    made inside a higher-order region are absent: writes to those, and to a tensor with a view
    already taken, stay refused."""
    root, first_view = {}, {}
    for i, n in enumerate(graph.nodes):
        if n.op == "placeholder" and n in inputs:
            root[n] = n
            continue
        if n.op != "call_function":
            continue
        if _same_tensor(n) and n.args[0] in root:
            root[n] = root[n.args[0]]
            continue
        if n.target is operator.getitem:
            src = n.args[0]
            if isinstance(src, torch.fx.Node) and not _returns_alias(src.target) and hasattr(src.target, "_schema"):
                root[n] = n  # one result of a multi-output op, fresh memory (not split's views)
            continue
        if not hasattr(n.target, "_schema"):
            continue  # a region: what it returns is not known fresh
        written = _written(n)
        if written:
            w = written[0]
            if len(written) == 1 and isinstance(w, torch.fx.Node) and w in root and root[w] not in first_view:
                root[n] = root[w]
            continue
        if _returns_alias(n.target) and not _converts(n):
            for a in n.all_input_nodes:
                first_view.setdefault(root.get(a, a), i)
            continue
        root[n] = n
    return root


def _out_of_place(name: str) -> str:
    """The out-of-place op of in-place `name`: add_ -> add, __iand__ -> __and__."""
    if name.startswith("__i") and name.endswith("__"):
        return "__" + name[3:]
    return name[:-1]


def _overload(name: str, overload: str):
    """aten.`name`.`overload`, or its .default where the in-place op's is .Tensor (floor_divide_);
    None if PyTorch has neither."""
    packet = getattr(torch.ops.aten, name, None)
    found = getattr(packet, overload, None)
    if found is None and overload == "Tensor":
        found = getattr(packet, "default", None)
    return found


def _translate_in_place(b: Builder, node, resolve, env, expr, owned: dict, updated: dict, state_of: dict):
    """`x.op_(...)` on a tensor the program owns, or on one of the user's inputs: x's value from
    here on is `op(x, ...)`. Every later reader of x, or of an earlier in-place result on it,
    reads the new value (the graph runs in order, so rebinding them all here is exactly
    eager's). For an input, `updated[placeholder]` is its newest value: the program's write."""
    name = _op_name(node.target)
    written, root = _written(node), owned.get(node)
    why = None
    if root is None:
        what = state_of.get(node.args[0])
        if what is not None:  # (a batch norm in training mode counts its batches and updates its statistics)
            why = (f"here it writes the module's {what}; where that is a module in training mode updating its "
                   f"state, as a batch norm's statistics, compile the module after .eval()")
        else:
            why = "here it writes a weight or buffer, a view, or a tensor a view was taken of"
    elif len(written) != 1 or written[0] is not node.args[0]:
        why = "here it writes other than its first argument"
    if why is None:
        functional = _out_of_place(name)
        _translate(b, node, resolve, env, {}, expr, functional=functional)
        if node not in env:
            why = f"PyTorch has no out-of-place aten.{functional}.{node.target._overloadname} to run it as"
    if why is not None:
        # The Graph IR is pure: a write it cannot account for would be lost, a wrong answer. Refuse.
        raise CaptureError(f"aten.{name} writes to a tensor in place, which tilefuse supports only on an input "
                           f"or a tensor the program made itself, with no view of it taken before the write ({why}); "
                           f"write it out of place" + (f" ({where})" if (where := source_of(node, expr)) else ""))
    if root.op == "placeholder" and b.type(env[node]) != b.type(env[root]):
        # squeeze_, t_, resize_: the caller's tensor would change its shape (or its storage)
        where = source_of(node, expr)
        raise CaptureError(f"aten.{name} changes the shape of input {root.name} in place "
                           f"({b.type(env[root])} -> {b.type(env[node])}), which tilefuse does not do to a "
                           f"caller's tensor; reshape it out of place" + (f" ({where})" if where else ""))
    for other, r in owned.items():
        if r is root and other in env:
            env[other] = env[node]
    if root.op == "placeholder":
        updated[root] = env[node]


def _translate(b: Builder, node, resolve, env, tuple_outputs, expr, functional: str | None = None):
    """One aten node to Graph IR. `functional`: the out-of-place op to translate an in-place
    node as (its result becomes the node's value; see _translate_in_place)."""
    name = functional or _op_name(node.target)
    if name == "detach_":
        # writes autograd metadata only, never values: torch.export emits it after lifting a
        # `torch.tensor(...)` literal (lift_fresh_copy + detach_), and transformers' KV cache makes one
        env[node] = resolve(node.args[0])
        return
    val = node.meta.get("val")
    if val is None:
        if name == "_assert_tensor_metadata" or not node.users:
            return
        raise CaptureError(f"{name} returns nothing tilefuse can use ({b.source})")
    multi = isinstance(val, (tuple, list))
    first = val[0] if multi else val
    if not isinstance(first, torch.Tensor):
        if name in ("item", "_local_scalar_dense"):
            raise CaptureError(f"aten.{name} reads a tensor's value into Python ({b.source}), which a compiled "
                               f"program cannot do: keep the value a tensor (`.item()`, `.tolist()`, `float(t)` "
                               f"make one; under torch.compile dynamo also makes one for a Python number it treats "
                               f"as dynamic, an argument that changes between calls or a module's float attribute "
                               f"under dynamic=True: pass that number as a tensor, or compile without dynamic=True)")
        raise CaptureError(f"{name} returns {type(first).__name__}, not a tensor ({b.source})")
    out = Out(_static_shape(first, name, b.source), dtypes.from_torch(first.dtype), name,
              _target_text(node.target) if functional is None else "")
    args = resolve(node.args)
    kwargs = {k: resolve(v) for k, v in node.kwargs.items()}
    handler = aten.HANDLERS.get(name)
    result = None
    reason = f"tilefuse does not lower aten.{name}"
    if handler is not None:
        try:
            result = handler(b, args, kwargs, out)
        except aten.Unsupported as e:
            reason = f"tilefuse does not lower aten.{name} with {e}"
    if isinstance(result, tuple):  # a translator that returns every output
        shapes = [tuple(int(s) for s in v.shape) for v in val]
        if [b.type(r).shape for r in result] != shapes:
            raise CaptureError(f"internal: aten.{name} translated to shapes {[b.type(r).shape for r in result]}, "
                               f"torch says {shapes} ({b.source})")
        tuple_outputs[node] = result
        return
    if result is None and functional:
        # the out-of-place overload runs in PyTorch (an extern of the in-place op would write its input)
        target = _overload(functional, node.target._overloadname)
        if target is None or multi:
            return  # the caller refuses
        result = _extern(b, node, args, kwargs, out, reason, target)
    if result is None and multi:
        # one extern per tensor result, each picking its own (ir.Extern.item) and running the op;
        # an unused one is dropped with the program's dead nodes, a non-tensor result cannot be
        # read (getitem). Two runs of a random op draw twice: its results would not agree
        used = {u.args[1] for u in node.users if u.target is operator.getitem and u.users}
        if len(used) > 1 and any(word in name for word in RANDOM_WORDS):
            raise CaptureError(f"aten.{name} draws random numbers and returns {len(val)} tensors, {len(used)} of "
                               f"them used; tilefuse would run it once for each, each with its own draw "
                               f"({b.source})")
        tuple_outputs[node] = tuple(
            _extern(b, node, args, kwargs, Out(_static_shape(v, name, b.source), dtypes.from_torch(v.dtype), name),
                    reason, item=k) if isinstance(v, torch.Tensor) else None
            for k, v in enumerate(val))
        return
    if result is None:
        result = _extern(b, node, args, kwargs, out, reason)
    t = b.type(result)
    if t.shape != out.shape and name == "linalg_vector_norm":
        raise CaptureError(f"torch.export says aten.linalg_vector_norm gives shape {out.shape}, where PyTorch computes "
                           f"{t.shape}: this PyTorch's ({torch.__version__}) shape function keeps a reduced dim of size "
                           f"1, so the shapes after it cannot be trusted; norm with keepdim=True, or squeeze that dim "
                           f"first ({b.source})")
    if t.shape != out.shape:
        raise CaptureError(f"internal: aten.{name} translated to shape {t.shape}, torch says {out.shape} ({b.source})")
    if t.dtype != out.dtype:
        result = b.cast(result, out.dtype)
    if multi:
        tuple_outputs[node] = result
    env[node] = result


def _static_shape(t, name: str, source) -> tuple[int, ...]:
    """A result's shape as ints; one that depends on the data (x[mask], nonzero) is refused by
    name, not left to torch's long guard error."""
    try:
        return tuple(int(s) for s in t.shape)
    except Exception as e:  # torch's GuardOnDataDependentSymNode (an unbacked size)
        if "data-dependent" not in str(e) and "DataDependent" not in type(e).__name__:
            raise
        where = f" ({source})" if source else ""
        raise CaptureError(f"aten.{name}'s result has a size that depends on the tensors' values{where}; "
                           f"tilefuse compiles programs of fixed shapes") from None


def _extern(b, node, args, kwargs, out, reason, target=None, item=None):
    def refs(a):
        if isinstance(a, str) and a in b.types:
            return ir.Ref(a)
        if isinstance(a, (list, tuple)):
            return tuple(refs(x) for x in a)
        return a

    kw = tuple((k, refs(v)) for k, v in kwargs.items() if k not in ("device", "pin_memory", "layout"))
    return b.add(ir.Extern(b.fresh(out.op), ir.TensorType(out.shape, out.dtype), _target_text(target or node.target),
                           refs(tuple(args)), kw, reason, b.source, item))
