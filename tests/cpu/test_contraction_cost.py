"""What matching a contraction's epilogue visits (graph/contraction.py `match`).

Only a node that reads a member of the epilogue can join it, so `match` walks the readers of
members in graph order rather than every node after the contraction: its work does not grow
with what follows. (Scanning the rest of the graph per contraction, and listing every node that
depended on it, made lowering quadratic in a model's layers: 7.5 s for a 32-layer Llama of
width 256 on the CPU, 2.2 s after; bench/LOG_blocks.md, session 38.)

Properties:
- a GEMM + bias + tanh followed by 3000 nodes that do not read it is matched to the same epilogue
  as with nothing after it, looking at no more than a handful of nodes;
- a GEMM whose output starts a chain of maps three times MAX_EPILOGUE long takes at most
  MAX_EPILOGUE of them, and looks at no more nodes than that (no candidate past them is chosen).
"""
from __future__ import annotations

import pytest

from tilefuse.graph import contraction, ir

T = ir.TensorType


def _gemm_bias_gelu(tail: int, chain: int = 0) -> ir.Graph:
    """x @ w + b, then tanh; `chain` more maps after it; `tail` maps of another input after all."""
    nodes = [ir.Input("x", T((64, 128), "bf16")), ir.Input("z", T((64, 128), "bf16")),
             ir.Weight("w", T((128, 256), "bf16")), ir.Weight("b", T((256,), "bf16")),
             ir.Contraction("mm", T((64, 256), "f32"), "x", "w"),
             ir.Map("bias", T((64, 256), "f32"), "add", ("mm", "b")),
             ir.Map("act", T((64, 256), "f32"), "tanh", ("bias",))]
    last = "act"
    for i in range(chain):
        nodes.append(ir.Map(f"c{i}", T((64, 256), "f32"), "neg", (last,)))
        last = f"c{i}"
    out = ir.Map("out", T((64, 256), "bf16"), "cast", (last,))
    nodes.append(out)
    prev = "z"
    for i in range(tail):
        nodes.append(ir.Map(f"t{i}", T((64, 128), "bf16"), "neg", (prev,)))
        prev = f"t{i}"
    return ir.Graph(tuple(nodes), ("x", "z"), ("out", prev))


def _counting(monkeypatch) -> list:
    seen = []
    real = contraction._epilogue_op

    def counted(n):
        seen.append(n.name)
        return real(n)

    monkeypatch.setattr(contraction, "_epilogue_op", counted)
    return seen


def test_nodes_after_a_contraction_that_do_not_read_it_are_not_visited(monkeypatch):
    small, big = _gemm_bias_gelu(0), _gemm_bias_gelu(3000)
    want = contraction.match(small, small["mm"])
    assert isinstance(want, contraction.GemmSpec) and set(want.maps) == {"bias", "act", "out"}
    seen = _counting(monkeypatch)
    got = contraction.match(big, big["mm"])
    assert repr(got) == repr(want)
    assert not any(name.startswith("t") for name in seen) and len(seen) <= 10, seen


def test_a_chain_longer_than_an_epilogue_is_walked_only_as_far_as_it_can_join(monkeypatch):
    g = _gemm_bias_gelu(0, chain=3 * contraction.MAX_EPILOGUE)
    seen = _counting(monkeypatch)
    spec = contraction.match(g, g["mm"])
    assert isinstance(spec, contraction.GemmSpec) and len(spec.maps) <= contraction.MAX_EPILOGUE
    assert len(seen) <= contraction.MAX_EPILOGUE + 2, len(seen)
