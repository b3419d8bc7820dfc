"""Sizes made with no compile where a kernel's only part in a changing shape is a small cast.

transformers 5.17 passes `generate`'s attention mask, one longer each step, into the decode
step, which casts it to bool before indexing it down to the window. The cast was a tilefuse
kernel over a tensor whose shape changes with the sizes, so no size could be made from
another (runtime.resize) and each compiled. Now such small maps run in PyTorch once two sizes
show it (runtime.resize.torch_maps, graph.fusion.plan's `in_torch`).

Properties:
- eager's results at every size, and most sizes made with no compile, saying why;
- the planner puts a named cast in a PyTorch step, and run_extern runs it with the map's dtype;
  the logic and comparison maps (transformers 5.17 ands that cast with a causal mask) run
  there with the interpreter's results;
- a map over a large varying tensor, or one whose PyTorch rounding could differ from a
  kernel's (an add), is left in its kernel.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tilefuse.frontend import backend as tb
from tilefuse import ops
from tilefuse.graph import fusion, ir
from tilefuse.runtime import resize
from tilefuse.runtime.program import run_extern


def _decode_like(x, mask, idx):
    sel = mask.to(torch.bool)[:, idx]  # (1, s) -> (1, 8): a cast, then an index extern
    return torch.where(sel, x, 0.0) * 2 + 1


@pytest.mark.usefixtures("fresh_backend")
def test_a_small_cast_over_a_growing_mask_runs_in_pytorch_and_later_sizes_need_no_compile():
    cf = torch.compile(_decode_like, backend="tilefuse")
    x = torch.randn(1, 8)
    with torch.no_grad():
        for s in range(10, 22):
            mask = (torch.arange(s) % 3 != 0).to(torch.int64)[None]
            idx = torch.arange(s - 8, s)
            got, want = cf(x, mask, idx), _decode_like(x, mask, idx)
            assert torch.equal(got, want), (s, got, want)
    r = max(tb.reports(), key=lambda r: r.variants)
    assert r.calls_eager == 0 and r.exports == 1, tb.summary()
    assert any("runs in PyTorch from the next size on" in e for e in r.events), tb.summary()
    assert r.resized >= r.variants - 4, tb.summary()  # (two sizes show it, two more make the family)


def _graph(n: int, op: str = "cast"):
    x = ir.Input("x", ir.TensorType((1, n), "i64"))
    y = ir.Map("y", ir.TensorType((1, n), "bool" if op == "cast" else "i64"), op, ("x",) if op != "add" else ("x", "x"))
    z = ir.Map("z", ir.TensorType((1, n), "bool"), "cast", ("y",)) if op != "cast" else None
    nodes = (x, y) + ((z,) if z else ())
    return ir.Graph(nodes, ("x",), (nodes[-1].name,), {})


def test_the_planner_runs_a_named_cast_in_pytorch_and_run_extern_computes_it():
    g = _graph(12)
    p = fusion.plan(g, in_torch=frozenset({"y"}))
    (step,) = [s for s in p.steps if "y" in s.nodes]
    assert step.family == "extern" and "PyTorch" in step.note
    assert fusion.plan(g).steps[0].family == "mapreduce"  # (without the option: a kernel, as before)
    x = torch.tensor([[0, 1, 2, 0, 5, 0, 0, 0, 0, 0, 0, 3]])
    out = run_extern(g["y"], lambda name: x)
    assert out.dtype == torch.bool and torch.equal(out, x.to(torch.bool))


class _P:
    def __init__(self, g):
        self.graph, self.plan = g, fusion.plan(g)


def test_only_small_casts_over_changing_shapes_are_picked():
    assert resize.torch_maps(_P(_graph(12)), _P(_graph(13))) == {"y"}
    big = resize.SMALL + 1
    assert resize.torch_maps(_P(_graph(big)), _P(_graph(big + 1))) == frozenset()
    assert resize.torch_maps(_P(_graph(12, "add")), _P(_graph(13, "add"))) == frozenset()  # not a cast


@pytest.mark.parametrize("op", sorted(fusion.TORCH_MAPS - {"cast"}))
def test_each_logic_map_run_in_pytorch_gives_the_interpreters_result(op):
    gen = torch.Generator().manual_seed(1)
    kind = ops.info(op).kind
    args = [torch.randint(0, 2, (3, 7), generator=gen).to(torch.bool) if kind == "logic"
            else torch.randint(-2, 3, (3, 7), generator=gen) for _ in range(ops.info(op).arity)]
    names = [f"a{i}" for i in range(len(args))]
    n = ir.Map("y", ir.TensorType((3, 7), "bool"), op, tuple(names))
    out = run_extern(n, dict(zip(names, args)).__getitem__)
    want = ops.info(op).numpy(*(a.numpy() for a in args))
    assert out.dtype == torch.bool and np.array_equal(out.numpy(), want), (op, out, want)
