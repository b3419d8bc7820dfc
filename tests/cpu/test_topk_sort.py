"""topk, sort and other ops with several results (max/min and var_mean:
test_multi_output_ops.py). topk and sort: the indices come from PyTorch's own op (the same
overload and arguments, so ties fall as eager's do) and the values are the input gathered at
them, so both equal eager exactly. An op with several results and no translator
(kthvalue, cummax, ...) is an extern per result used (ir.Extern.item), each shown in the plan
with the result it picks; an unused result leaves no node."""
import pytest
import torch

import tilefuse
from tilefuse.graph import ir


def _externs(p):
    """The aten ops the plan leaves to PyTorch (a gather of an integer table, which a kernel
    does not take, is torch.gather, not one of these)."""
    nodes = [p.plan.graph[s.nodes[0]] for s in p.plan.steps if s.family == "extern" and not s.view]
    return [n for n in nodes if isinstance(n, ir.Extern)]


@pytest.mark.parametrize("name, fn", [
    ("topk", lambda x, e: torch.topk(x, 3)),
    ("topk smallest dim 0", lambda x, e: torch.topk(x, 2, dim=0, largest=False)),
    ("topk unsorted", lambda x, e: torch.topk(x * 2, 4, sorted=False)),
    ("sort", lambda x, e: torch.sort(x)),
    ("sort descending dim 0", lambda x, e: torch.sort(x, dim=0, descending=True)),
    ("sort stable ints with ties", lambda x, e: torch.sort(e, stable=True)),
    ("argsort", lambda x, e: (torch.argsort(e, stable=True), torch.argsort(x, dim=0))),
    ("sort of bf16 ties", lambda x, e: torch.sort(x.to(torch.bfloat16).round(), stable=True, descending=True)),
])
def test_topk_and_sort_equal_eager_exactly(name, fn):
    torch.manual_seed(0)
    x, e = torch.randn(12, 10), torch.randint(0, 4, (40,))
    p = tilefuse.compile(fn, (x, e))
    got, want = p(x, e), fn(x, e)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w), (g, w)
    externs = _externs(p)
    assert externs and all(n.target.split(".")[1] in ("topk", "sort") and n.item == 1 for n in externs), externs


def test_topk_values_are_a_gather_fused_with_the_maps_after_it():
    """The router's weights: softmax, top-2 values, renormalised. The values are gathered in the
    kernel that renormalises them, beside one extern for the order; the experts chosen equal
    eager's, the weights within float32 rounding (the softmax is a kernel's own)."""
    fn = lambda x: (lambda v, i: (v / v.sum(-1, keepdim=True), i))(*torch.topk(x.softmax(-1), 2))  # noqa: E731
    x = torch.randn(64, 8)
    p = tilefuse.compile(fn, (x,))
    (w, i), (w0, i0) = p(x), fn(x)
    assert torch.equal(i, i0)
    torch.testing.assert_close(w, w0, rtol=1e-6, atol=1e-7)
    g = p.plan.graph
    assert [n.target for n in _externs(p)] == ["aten.topk.default"]
    gathers = [n for n in g.nodes if isinstance(n, ir.Gather)]
    assert len(gathers) == 1
    owner = [s for s in p.plan.steps if gathers[0].name in s.nodes]
    assert owner and owner[0].family == "mapreduce" and len(owner[0].nodes) > 1, str(p.plan)
    assert "[1]" in str(p.plan.graph) and "the order of topk runs in PyTorch" in str(p.plan.graph)


@pytest.mark.parametrize("name, fn, item", [
    ("kthvalue values", lambda x: torch.kthvalue(x, 3, dim=-1).values * 2, 0),
    ("kthvalue indices", lambda x: torch.kthvalue(x, 3, dim=-1).indices, 1),
    ("cummax indices", lambda x: torch.cummax(x, dim=1)[1] + 1, 1),
    ("mode", lambda x: torch.mode(x.round(), dim=-1)[0], 0),
])
def test_an_untranslated_op_with_several_results_is_one_extern_per_result_used(name, fn, item):
    torch.manual_seed(1)
    x = torch.randn(8, 16)
    p = tilefuse.compile(fn, (x,))
    torch.testing.assert_close(p(x), fn(x), rtol=0, atol=0)
    externs = _externs(p)
    assert len(externs) == 1 and externs[0].item == item, externs
    assert f"[{item}]" in externs[0].describe()


def test_both_results_of_an_untranslated_op_run_as_two_externs_equal_to_eager():
    fn = lambda x: torch.kthvalue(x, 3, dim=0)  # noqa: E731 (cummin's values are a scan now)
    x = torch.randn(9, 5)
    p = tilefuse.compile(fn, (x,))
    got, want = p(x), fn(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert sorted(n.item for n in _externs(p)) == [0, 1]


def test_a_random_op_with_two_results_used_is_refused_not_drawn_twice():
    """native_dropout's output and mask come from one draw; two externs would draw twice and
    disagree (o - x * m * 2 was 7.9 where eager's is 0). Refused, naming the op; one result
    used is one extern, one draw."""
    from tilefuse.frontend.capture import CaptureError

    def both(x):
        o, m = torch.ops.aten.native_dropout(x, 0.5, True)
        return o - x * m * 2.0

    with pytest.raises(CaptureError, match="native_dropout draws random numbers"):
        tilefuse.compile(both, (torch.randn(8, 8),))
    p = tilefuse.compile(lambda x: torch.ops.aten.native_dropout(x, 0.5, True)[1], (torch.randn(8, 8),))
    assert len(_externs(p)) == 1


def test_an_unread_result_that_is_not_a_tensor_or_not_translated_is_no_error():
    """torch.export names every result; one nothing reads (native_layer_norm's mean and rstd,
    which its translator does not make) is skipped, not refused."""
    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    fn = lambda x, w, b: torch.ops.aten.native_layer_norm(x, [8], w, b, 1e-5)[0] * 2  # noqa: E731
    p = tilefuse.compile(fn, (x, w, b))
    torch.testing.assert_close(p(x, w, b), fn(x, w, b), rtol=1e-5, atol=1e-5)
