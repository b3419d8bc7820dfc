"""Shared by the CODA rule tests: capture a module to Graph IR, run graphs on the interpreter,
and the two equivalence checks every rule must pass.

- exact: on a float64 module the rewritten graph computes the same function as the
  original, to float64 rounding (relative error <= 1e-12), through graph/interp.py;
- bf16: on a bf16 module the rewritten graph, run at its own precision, is within
  DESIGN.md's 2x rule (`tilefuse.check.compare`) of a float64 reference.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tilefuse.check import compare, float64_reference, rel_error
from tilefuse.frontend.capture import export, to_graph
from tilefuse.graph import ir
from tilefuse.graph.interp import run_graph
from tilefuse.tensors import to_torch

EXACT = 1e-12


def capture(module: torch.nn.Module, *inputs) -> ir.Graph:
    return to_graph(export(module, inputs))


def run(g: ir.Graph, inputs, precision: str = "native") -> torch.Tensor:
    outs = run_graph(g, dict(zip(g.inputs, inputs)), precision)
    return to_torch(outs[0]).reshape(outs[0].shape)


def run_all(g: ir.Graph, inputs, precision: str = "native") -> list[torch.Tensor]:
    """Every output of g, run by the Graph IR interpreter."""
    return [to_torch(o).reshape(o.shape) for o in run_graph(g, dict(zip(g.inputs, inputs)), precision)]


def bf16_through_coda(module: torch.nn.Module, rule, *inputs):
    """(the module in bf16, its bf16 inputs, its graph after the CODA rules, `rule` applied to that)."""
    from tilefuse.graph.rules import run_coda

    module = randomise_norms(module).to(torch.bfloat16).eval()
    xs = [x.bfloat16() for x in inputs]
    g = run_coda(capture(module, *xs))[0]
    return module, xs, g, rule(g)


def randomise_norms(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Norm weights (and biases) away from their 1 / 0 init, so folding them is really tested."""
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            with torch.no_grad():
                if m.weight is not None:
                    m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g))
    return module


def assert_exact(module: torch.nn.Module, rule, *inputs, fires: bool = True) -> tuple[ir.Graph, ir.Graph]:
    """The rule (fired or not, as expected) leaves the f64 function unchanged."""
    m64 = copy.deepcopy(module).double().eval()
    x64 = [x.double() if x.is_floating_point() else x for x in inputs]
    g = capture(m64, *x64)
    g2 = rule(g)
    assert (g2 is not g) == fires, f"{rule.__name__} {'did not fire' if fires else 'fired'}"
    err = rel_error(run(g2, x64, "f64"), run(g, x64, "f64"))
    assert err <= EXACT, f"{rule.__name__}: rewritten graph differs by {err:.3g}"
    return g, g2


def assert_bf16(module: torch.nn.Module, rule, *inputs) -> ir.Graph:
    """On a bf16 module, the rewritten graph passes the 2x rule against float64."""
    mb = copy.deepcopy(module).to(torch.bfloat16).eval()
    xb = [x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs]
    g2 = rule(capture(mb, *xb))
    with torch.no_grad():
        eager = mb(*xb)
    c = compare(rule.__name__, run(g2, xb), float64_reference(mb, xb), eager)
    assert c.ok, c
    return g2


def nodes_of(g: ir.Graph, kind) -> list:
    return [n for n in g.nodes if isinstance(n, kind)]


class ResidualNormLinear(nn.Module):
    """h = x + O(a) (a residual GEMM), then a norm of h into one or more projections; h returned
    too (the residual stream goes on), and with `norm_out` the normalised tensor itself.
    norm="rms": RMSNorm, no biases; norm="layer": LayerNorm, biases on O and the first projection."""

    def __init__(self, d=256, n=384, heads=2, norm_out=False, norm="rms"):
        super().__init__()
        layer = {"rms": False, "layer": True}[norm]
        self.o = nn.Linear(d, d, bias=layer)
        self.norm = nn.LayerNorm(d, eps=1e-5) if layer else nn.RMSNorm(d, eps=1e-5)
        self.proj = nn.ModuleList(nn.Linear(d, n, bias=layer and i == 0) for i in range(heads))
        self.norm_out = norm_out

    def forward(self, x, a):
        h = x + self.o(a)
        z = self.norm(h)
        y = sum(p(z) for p in self.proj)
        return (y, h, z) if self.norm_out else (y, h)
