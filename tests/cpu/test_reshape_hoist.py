"""graph/rules/reshape_hoist.py: a reshape that regroups the leading dims of a map's result
([T, D] -> [B, S, D]) moves onto the map's arguments, through reshapes and row gathers, up to
tensors in memory, so the maps run in the kernel that reads the reshape; the rewritten graph
computes what PyTorch does (the interpreter, random shapes), and a mixture of experts' combine,
its residual add and the next RMSNorm's statistics are one kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.frontend.capture import export, to_graph
from tilefuse.graph import ir
from tilefuse.graph.interp import run_graph, to_torch
from tilefuse.graph.rules.reshape_hoist import leading_reshapes_into_maps


def _graph(fn, inputs):
    return to_graph(export(fn, inputs))


def _run(g, inputs):
    return [to_torch(a).reshape(a.shape) for a in run_graph(g, dict(zip(g.inputs, inputs)))]


def _reshapes_of_maps(g):
    """Reshapes left reading a map or a gather (but a gather's table, read where it lies)."""
    tables = {n.arg for n in g.nodes if isinstance(n, ir.Gather)}
    return [n.name for n in g.nodes if isinstance(n, ir.View) and n.op == "reshape"
            and isinstance(g[n.arg], (ir.Map, ir.Gather)) and n.name not in tables]


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_the_rewritten_graph_computes_what_pytorch_does(data):
    b, s, d = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 9))
    x, rowv, colv = torch.randn(b * s, d), torch.randn(b * s, 1), torch.randn(d)
    idx = torch.randint(0, b * s, (b * s,))
    gathered = data.draw(st.booleans())

    def fn(x, rowv, colv, idx, r):
        t = torch.logcumsumexp(x, -1)  # (an extern: a tensor in memory)
        y = torch.tanh(t * rowv + colv) * 2
        y = y[idx] if gathered else y
        return r + y.view(b, s, d)

    r = torch.randn(b, s, d)
    g = _graph(fn, (x, rowv, colv, idx, r))
    out = leading_reshapes_into_maps(g)
    assert not _reshapes_of_maps(out), str(out)
    (got,) = _run(out, (x, rowv, colv, idx, r))
    torch.testing.assert_close(got, fn(x, rowv, colv, idx, r), rtol=1e-6, atol=1e-6)


def test_an_moe_combine_its_residual_and_the_next_norm_are_one_kernel():
    """The combine over the flattened tokens ([T, D]) and the residual add and RMSNorm over
    [B, S, D]: one kernel, reading the expert rows where they lie; no [T, D] combine written."""
    def fn(y, w, inv, r):
        c = (torch.where(w > 0.1, y.float(), 0.0) * w)[inv].view(-1, 2, y.shape[-1]).sum(1).to(y.dtype)
        h = r + c.view(r.shape)
        return h, F.rms_norm(h.float(), (y.shape[-1],))

    y, w = torch.randn(64, 8, dtype=torch.bfloat16), torch.rand(64, 1)
    inv, r = torch.randperm(64), torch.randn(2, 16, 8, dtype=torch.bfloat16)
    p = tilefuse.compile(fn, (y, w, inv, r))
    (rows,) = [s for s in p.plan.steps if s.family == "mapreduce" and "args_0" in " ".join(s.inputs)]
    assert set(p.graph.outputs) <= set(rows.outputs), str(p.plan)
    for got, want in zip(p(y, w, inv, r), fn(y, w, inv, r)):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fn", [
    lambda x, w: (x * w).reshape(6, 8).sum(0),
    lambda x, w: (x * w).reshape(6, 8).t() * 2,
    lambda x, w: torch.softmax((x * w + 1).reshape(6, 8), -1),
])
def test_a_merge_keeps_an_argument_of_more_dims_within_the_maps_rank(fn):
    """Merging [2, 3, 8] into [6, 8]: a weight of [1, 1, 8] beside it is viewed as [1, 8], so
    the map's arguments still broadcast to its shape (review, session 63: it was left [1, 1, 8],
    the sum reduced the wrong dim, the transpose failed to compile)."""
    x, w = torch.randn(2, 3, 8), torch.randn(1, 1, 8)
    g = leading_reshapes_into_maps(_graph(fn, (x, w)))
    for n in g.nodes:
        if isinstance(n, ir.Map):
            assert all(len(g[a].type.shape) <= len(n.type.shape) for a in n.args), str(g)
    torch.testing.assert_close(_run(g, (x, w))[0], fn(x, w), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tilefuse.compile(fn, (x, w))(x, w), fn(x, w), rtol=1e-5, atol=1e-5)


def test_a_map_whose_reshape_is_also_a_gathers_table_stays_whole():
    """m read as [2, 3, 8] by a map and, through another reshape, as a gather's table: moving
    the first would compute m twice (review, session 63)."""
    def fn(x, i):
        m = torch.logcumsumexp(x, -1).exp() * 2
        return m.view(2, 3, 8)[i], m.view(2, 3, 8) + 1

    x, i = torch.randn(6, 8), torch.randint(0, 2, (4,))
    g = _graph(fn, (x, i))
    assert leading_reshapes_into_maps(g) is g


@pytest.mark.parametrize("name, fn", [
    # a norm computed over the flattened rows: its statistics are a reduction's, not in memory
    ("a reduction above", lambda x, r: r + F.rms_norm(torch.logcumsumexp(x, -1), (8,)).view(2, 3, 8)),
    ("the map read whole too", lambda x, r: (lambda m: (r + m.view(2, 3, 8), m.sum()))(torch.logcumsumexp(x, -1) * 2)),
    ("the map a result", lambda x, r: (lambda m: (m, r + m.view(2, 3, 8)))(torch.logcumsumexp(x, -1) * 2)),
    ("after a matmul", lambda x, r: r + torch.relu(x @ x.T @ x).view(2, 3, 8)),
    ("the last dim changes", lambda x, r: r.view(2, 3, 2, 4) + (torch.logcumsumexp(x, -1) * 2).view(2, 3, 2, 4)),
])
def test_not_taken_leaves_the_graph_as_it_is(name, fn):
    x, r = torch.randn(6, 8), torch.randn(2, 3, 8)
    g = _graph(fn, (x, r))
    assert leading_reshapes_into_maps(g) is g, name


def _hf_loss(x, w, labels):
    """What transformers' causal LM returns with labels: bf16 logits and the f32 loss computed
    from `logits.float()` flattened to [B*S, V] (its ForCausalLMLoss, the shift left out)."""
    logits = x @ w.t()
    return logits, F.cross_entropy(logits.float().view(-1, w.shape[0]), labels.view(-1), ignore_index=-100)


@pytest.mark.parametrize("b, s, d, v", [(2, 8, 32, 96), (1, 5, 16, 40), (3, 1, 24, 200)])
def test_returned_logits_are_read_by_the_loss_kernel_as_they_lie(b, s, d, v):
    """The logits are returned, so the GEMM stores them (bf16); the loss's f32 cast of them,
    read under a reshape to [B*S, V], is computed in the loss's kernel from those bf16 logits.
    Before, the reshape ended that kernel's rows: the GEMM's epilogue also wrote f32 logits,
    three times the bytes of the bf16 ones moved again (a 2-layer Mistral's 32000-wide LM head
    took 1.56 ms for 0.78 on an H200, bench/LOG_blocks.md session 72)."""
    x, w = torch.randn(b, s, d, dtype=torch.bfloat16), torch.randn(v, d, dtype=torch.bfloat16)
    labels = torch.randint(0, v, (b, s))
    labels[0, 0] = -100
    p = tilefuse.compile(_hf_loss, (x, w, labels))
    (gemm,) = [st for st in p.plan.steps if st.family == "gemm"]
    assert [p.graph[o].type.dtype for o in gemm.outputs] == ["bf16"], str(p.plan)
    wide = [o for st in p.plan.steps for o in st.outputs
            if p.graph[o].type.dtype == "f32" and p.graph[o].type.numel >= b * s * v]
    assert not wide, f"f32 logits written: {wide}\n{p.plan}"
    for got, want in zip(p(x, w, labels), _hf_loss(x, w, labels)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_a_widening_of_a_value_not_returned_is_not_hoisted_from_a_matmul():
    """Only a returned (stored) value is read where it lies: a widening of a matmul's result
    that is not returned stays in the epilogue's reach (rules/lmhead_ce.py takes that loss)."""
    def fn(x, w):
        return torch.logsumexp((x @ w.t()).float().view(-1, w.shape[0]), -1)

    x, w = torch.randn(2, 4, 8), torch.randn(16, 8)
    g = _graph(fn, (x, w))
    assert leading_reshapes_into_maps(g) is g
