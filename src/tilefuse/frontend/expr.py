"""`-c` expressions: `torch.randn(...)` calls become the program's inputs, modules its weights.

"torch.nn.RMSNorm(2048)(torch.randn(1,32,2048))" becomes a module holding the RMSNorm
whose forward takes one input of shape (1, 32, 2048). Sub-expressions that do not touch
an input (module constructors, constants) are evaluated once, when the program is built,
and the modules are put in eval mode.
"""
from __future__ import annotations

import ast
import builtins
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FACTORIES = {"randn", "rand", "randint", "ones", "zeros", "empty", "full", "arange", "tensor"}


class ExprError(Exception):
    pass


@dataclass
class InputSpec:
    """How to make fresh values of one input: the factory call's text, evaluated again."""

    text: str

    def make(self, scope):
        return eval(self.text, scope)


def _scope():
    return {"torch": torch, "nn": nn, "F": F}


def _is_factory(node: ast.AST) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    return (isinstance(f, ast.Attribute) and f.attr in FACTORIES and isinstance(f.value, ast.Name)
            and f.value.id == "torch")


def _free_names(node: ast.AST) -> set[str]:
    """Names a sub-expression reads that it does not bind itself (a comprehension's targets, a
    lambda's parameters and walrus targets inside it are bound there)."""
    loaded, bound = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loaded if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
    return loaded - bound


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


class _Hoist(ast.NodeTransformer):
    """Replace factory calls with input names and input-free calls with bound constants.

    A call is input-free when every name it reads is torch, nn, F, a builtin or a module hoisted
    already: `x.sum()` of a walrus-bound x, or `F.relu(t)` of a comprehension's t, stays in the
    forward. What a comprehension or lambda runs once per item is left as written, so
    `nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])` is built whole, three layers; a
    factory there (a new input per item) is refused, and so is a module constructor left in
    the forward (new weights on every call: `check_per_item_modules`)."""

    def __init__(self, scope, text):
        self.scope, self.text = scope, text
        self.inputs: list[InputSpec] = []
        self.consts: dict[str, object] = {}
        self.known = set(scope) | set(dir(builtins))
        self.built_per_item: list[ast.Call] = []  # module constructors inside lambdas / comprehensions

    def visit_Call(self, node):
        if _is_factory(node):
            name = f"_in{len(self.inputs)}"
            self.inputs.append(InputSpec(ast.get_source_segment(self.text, node) or ast.unparse(node)))
            return ast.copy_location(ast.Name(name, ast.Load()), node)
        node = self.generic_visit(node)
        if _free_names(node) <= self.known | set(self.consts):
            try:  # modules hoisted already are in scope: `nn.Linear(4, 4).bfloat16()` calls a method of one
                value = eval(compile(ast.Expression(node), "<tilefuse -c>", "eval"), {**self.scope, **self.consts})
            except Exception as e:
                raise ExprError(f"cannot evaluate {ast.unparse(node)!r}: {e}") from None
            if isinstance(value, nn.Module):
                name = next((k for k, v in self.consts.items() if v is value), f"_m{len(self.consts)}")
                self.consts[name] = value
                return ast.copy_location(ast.Name(name, ast.Load()), node)
        return node

    def _per_item(self, parts, what: str, advice: str = "would make a new input per item: write each input out "
                  "(e.g. torch.stack([torch.randn(4), torch.randn(4)]))"):
        for part in parts:
            if any(_is_factory(n) for n in ast.walk(part)):
                raise ExprError(f"{what} {advice}")
            self.built_per_item += [n for n in ast.walk(part) if self._makes_module(n)]

    def _makes_module(self, node) -> bool:
        """Whether `node` calls a module class (nn.Linear(8, 8)), as far as names known here tell."""
        if not isinstance(node, ast.Call) or not _free_names(node.func) <= self.known | set(self.consts):
            return False
        try:
            f = eval(compile(ast.Expression(node.func), "<tilefuse -c>", "eval"), {**self.scope, **self.consts})
        except Exception:
            return False
        return isinstance(f, type) and issubclass(f, nn.Module)

    def check_per_item_modules(self, body):
        """Refuse a module the forward would build on every call (inside a lambda or a
        comprehension that was not built whole, as `nn.Sequential(*[...])` is): tracing it
        would trace its initialisation, and its weights would be new random ones each call."""
        left = {id(n) for n in ast.walk(body)}
        for n in self.built_per_item:
            if id(n) in left:
                raise ExprError(f"{ast.unparse(n)!r} is built inside a lambda or comprehension that runs in the "
                                f"program, so it would be a new module with new weights on every call: build it "
                                f"once outside and pass it in, e.g. (lambda f, x: f(x))({ast.unparse(n)}, torch.randn(...))")

    def _visit_comprehension(self, node):
        first, *rest = node.generators
        first.iter = self.visit(first.iter)  # evaluated once, before the first item
        parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        parts += [*first.ifs, *(x for g in rest for x in (g.iter, *g.ifs))]
        self._per_item(parts, f"a torch factory call inside {ast.unparse(node)!r}")
        return node

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _visit_comprehension

    def visit_Lambda(self, node):
        self._per_item([node.body], f"a torch factory call inside {ast.unparse(node)!r}",
                       "would run on each call of the lambda, not become one of the program's inputs: pass "
                       "the tensor in as an argument, e.g. (lambda x, c: x + c)(torch.randn(3), torch.ones(3))")
        return node


class ExprModule(nn.Module):
    """The expression as a module: hoisted modules are submodules, so their tensors are weights."""

    def __init__(self, text: str, body: ast.Expression, modules: dict, n_inputs: int):
        super().__init__()
        self.text = text
        self.mods = nn.ModuleDict(modules)
        # a function of the inputs, not an eval of the expression each call: torch.compile traces
        # a function's frame, and captured no graph from an eval's (it ran the expression in
        # eager: `tilefuse run --bench` timed eager twice, under both names)
        names = [ast.arg(f"_in{i}") for i in range(n_inputs)]
        fn = ast.Lambda(ast.arguments(posonlyargs=[], args=names, kwonlyargs=[], kw_defaults=[], defaults=[]),
                        body.body)
        self._code = compile(ast.fix_missing_locations(ast.Expression(fn)), "<tilefuse -c>", "eval")
        self._n = n_inputs
        self._fn = None

    def __getstate__(self):  # (copies and pickles: the function's globals hold modules; a copy makes its own)
        return {**self.__dict__, "_fn": None}

    def forward(self, *inputs):
        # one globals dict for every call: torch.compile installs the functions it compiles from
        # a lambda of the expression in that lambda's globals, and a fresh dict each call lost
        # them (NameError: __compiled_fn_..., `tilefuse run --bench` of a lambda)
        if self._fn is None:
            self._fn = eval(self._code, _scope())
        self._fn.__globals__.update(self.mods)
        return self._fn(*inputs)


def parse(text: str, dtype: torch.dtype | None = None):
    """Return (module, example inputs, input specs) for a `-c` expression."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))  # the AST of a long chain of calls is as deep as the chain
    try:
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as e:
            # (Python gives no column, or 0, where the text ends before the expression does)
            where = f"column {e.offset}" if e.offset and e.offset <= len(text.strip()) else "its end"
            raise ExprError(f"the expression does not parse: {e.msg} at {where}") from None
        hoist = _Hoist(_scope(), text.strip())
        body = ast.fix_missing_locations(hoist.visit(tree))
        hoist.check_per_item_modules(body)
        if not hoist.inputs:
            raise ExprError("the expression has no inputs: make them with torch.randn(...) inside it")
        # eval mode: tilefuse compiles forward programs (a BatchNorm uses its running statistics,
        # nn.Dropout passes values through), as a model serving requests runs
        module = ExprModule(text, body, hoist.consts, len(hoist.inputs)).eval()  # (compiles the AST: deep too)
    except (RecursionError, MemoryError):
        raise ExprError("the expression nests too deeply to read") from None
    finally:
        sys.setrecursionlimit(limit)
    try:
        inputs = [s.make(_scope()) for s in hoist.inputs]
    except Exception as e:
        raise ExprError(f"cannot make the inputs: {e}") from None
    if dtype is not None:
        module = module.to(dtype)
        inputs = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
    return module, inputs, hoist.inputs
