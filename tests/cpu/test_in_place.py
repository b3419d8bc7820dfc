"""In-place ops in a captured program. On a tensor the program made itself, with no view of it
taken before the write, an in-place op is an update of that tensor's value: it runs as its
out-of-place form, and every later reader (the tensor's own later uses included) sees the new
value, as in eager. A write into one of the caller's inputs is the same update, and the graph
records it (Graph.writes): the new value is copied into the caller's tensor after the run, or
computed in it where an extern's in-place form can (a static KV cache's `index_copy_`). A write
into a weight or buffer, through a view, or into a tensor with a view already taken is refused
with one clear error: the Graph IR is pure, so such a write would otherwise be silently lost."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tilefuse
from tilefuse.graph import ir
from tilefuse.frontend.capture import CaptureError


def _iadd(x):
    y = x * 2
    y += 1
    return y


def _chain(x):
    return x.clone().mul_(2).add_(1).clamp_(min=0.5)


def _old_value_kept(x):
    """z read y before the write: it keeps the old value; y's later readers see the new one."""
    y = x * 2
    z = y + 0
    y.mul_(3)
    return y, z, y * z


def _view_after_the_write(x):
    y = x * 2
    F.relu(y, inplace=True)
    return y.view(-1) * 3, y.reshape(6, 4)


def _silu(x):
    return F.silu(x - 0.5, inplace=True)


def _without_a_translator(x):
    """masked_fill_, zero_, fill_ and copy_ have no Graph IR translator: their out-of-place
    forms run in PyTorch, as externs."""
    sc = x @ x.T
    sc.masked_fill_(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    y = x * 2
    y.zero_()
    y.fill_(3.0)
    z = x + 1
    z.copy_(x * 5)
    return sc.softmax(-1), y + z


def _after_a_cast(x):
    """`.long()` of a float tensor is new memory, not a maybe-alias."""
    y = (x * 10).long()
    y.add_(3)
    return y


def _bitwise_and_shifts(x):
    """`&=`, `|=`, `^=`, `<<=`, `>>=` are aten.__iand__ and kin, whose out-of-place forms are
    __and__ and kin; floor_divide_.Tensor's is floor_divide.default."""
    y = (x * 10).int()
    y &= 6
    y |= 9
    y ^= 5
    y <<= 2
    y >>= 1
    y.floor_divide_(3)
    y.floor_divide_(torch.full_like(y, 2))
    m = x > 0
    m &= x < 1
    return y, m


def _through_a_no_op_float(x):
    y = x * 2
    y.float().add_(1)  # y is float: .float() returns y itself, and eager's y changes
    return y


def _through_a_no_op_contiguous(x):
    y = x * 2
    y.contiguous().add_(1)  # y is contiguous: the same
    return y


COMPILED = {
    "bitwise_and_shifts": _bitwise_and_shifts,
    "without_a_translator": _without_a_translator,
    "after_a_cast": _after_a_cast,
    "relu_inplace": nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Flatten(0), nn.Linear(24, 3)),
    "iadd": _iadd,
    "chain": _chain,
    "old_value_kept": _old_value_kept,
    "view_after_the_write": _view_after_the_write,
    "silu_inplace": _silu,
    "dropout_inplace_eval": nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3, inplace=True)).eval(),
    "through_a_no_op_float": _through_a_no_op_float,
    "through_a_no_op_contiguous": _through_a_no_op_contiguous,
}


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_an_in_place_op_on_the_programs_own_tensor_runs_out_of_place_as_eager(name):
    fn = COMPILED[name]
    x = torch.randn(6, 4)
    with torch.no_grad():
        prog = tilefuse.compile(fn, (x,))
        fresh = torch.randn(6, 4)
        got, want = prog(fresh.clone()), fn(fresh.clone())
    got, want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    externs = [n.target for n in prog.stages.graph.nodes if isinstance(n, ir.Extern)]
    in_place = [t for t in externs if t.split(".")[1].endswith("_") and not t.split(".")[1].endswith("__")
                or t.split(".")[1].startswith("__i")]
    assert not in_place, externs  # no in-place op run by torch


def _input(x):
    x.add_(1)
    return x * 2


def _through_a_view(x):
    y = x * 2
    y[0].add_(1)
    return y


def _after_a_view(x):
    y = x * 2
    v = y.view(-1)
    y.add_(1)
    return v * 1


class _Buffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        self.seen.add_(x.sum(0))
        return x * 2


REFUSED = {"through_a_view": _through_a_view, "after_a_view": _after_a_view, "buffer": _Buffer()}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_write_the_graph_could_lose_is_refused_naming_the_op(name):
    with torch.no_grad(), pytest.raises(CaptureError, match=r"aten\.add_ writes to a tensor in place"):
        tilefuse.compile(REFUSED[name], (torch.randn(6, 4),))


# -- writes into the caller's inputs ------------------------------------------------------------

def _input(x):
    x.add_(1)
    return x * 2


def _through_a_no_op_to(x):
    y = x.float()  # x is float: y is x itself, so the write is x's
    y.mul_(3)
    return x + 1


class _StaticCache(nn.Module):
    """One decode step on a fixed-size cache: the position read from a step counter the step
    advances, the new key written at it, attention over the whole cache (transformers' StaticLayer)."""

    def forward(self, q, k, cache, step):
        pos = torch.arange(1) + step
        step.add_(1)
        cache.index_copy_(2, pos, k)
        return F.scaled_dot_product_attention(q, cache, cache)


def _returns_the_updated_input(x):
    return x.mul_(2).add_(1)


def _returns_a_copy_from_before_the_write(x):
    old = x.clone()
    x.add_(1)
    return old * 1, old


def _returns_a_view_of_a_copy_from_before_the_write(x):
    old = x.clone()[1:]
    x.mul_(2)
    return old, old.reshape(-1)


@pytest.mark.parametrize("fn", [_input, _through_a_no_op_to, _returns_the_updated_input,
                                _returns_a_copy_from_before_the_write, _returns_a_view_of_a_copy_from_before_the_write])
def test_a_write_into_an_input_updates_the_callers_tensor_as_eager(fn):
    """The results and the caller's tensor after the call equal eager's, call after call, and no
    result shares the caller's memory (a value read before the write stays the value it was)."""
    with torch.no_grad():
        prog = tilefuse.compile(fn, (torch.randn(6, 4),))
        mine = torch.randn(6, 4)
        theirs = mine.clone()
        for _ in range(3):
            got, want = prog(mine), fn(theirs)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(mine, theirs)
            for t in torch.utils._pytree.tree_leaves(got):
                assert t.untyped_storage().data_ptr() != mine.untyped_storage().data_ptr()
    assert prog.stages.graph.writes and "write " in str(prog.stages.graph)


def test_a_static_cache_step_writes_its_token_in_the_cache_itself():
    """The cache's index_copy runs as index_copy_ on the caller's cache (no copy of the whole
    cache), the counter's add is copied back; eight steps fill the cache as eager's do."""
    from tilefuse.runtime.runner import in_place_writes

    m = _StaticCache()
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    with torch.no_grad():
        prog = tilefuse.compile(m, (q, k, torch.zeros(1, 2, 8, 8), torch.tensor(0)))
        g = prog.stages.graph
        assert set(in_place_writes(g, prog.stages.plan).values()) == {g.inputs[2]}
        cache, step = torch.zeros(1, 2, 8, 8), torch.tensor(0)
        cache_e, step_e = cache.clone(), step.clone()
        address = cache.data_ptr()
        for _ in range(8):
            q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
            torch.testing.assert_close(prog(q, k, cache, step), m(q, k, cache_e, step_e))
        assert cache.data_ptr() == address and int(step) == 8
        torch.testing.assert_close(cache, cache_e)


def test_a_value_the_rewrites_reduce_to_the_input_itself_is_the_input_as_given():
    """A sum over a size-1 axis read before the write becomes the input itself after the rewrites;
    a result naming an input is that input as given, so it is eager's value, not the update."""

    def fn(x):  # x: (1, 4)
        s = x.sum(0, keepdim=True)
        m = x.amax(0)
        x.add_(1)
        return s, m

    with torch.no_grad():
        prog = tilefuse.compile(fn, (torch.randn(1, 4),))
        mine = torch.randn(1, 4)
        theirs = mine.clone()
        torch.testing.assert_close(prog(mine), fn(theirs))
        torch.testing.assert_close(mine, theirs)


def _squeeze(x):
    x.squeeze_(0)
    return x * 1


def _transpose(x):
    x.t_()
    return x * 1


def _resize(x):
    x.resize_(1, 4)
    return x * 1


@pytest.mark.parametrize("fn", [_squeeze, _transpose, _resize])
def test_an_in_place_op_that_would_reshape_an_input_is_refused(fn):
    """squeeze_, t_ and resize_ change the caller's tensor's shape (or storage): refused by name."""
    with torch.no_grad(), pytest.raises(CaptureError, match="in place"):
        tilefuse.compile(fn, ({_squeeze: torch.randn(1, 4), _transpose: torch.randn(2, 4)}.get(fn, torch.randn(4, 4)),))


def test_an_in_place_op_that_adds_a_dim_to_an_input_is_refused_in_words():
    """unsqueeze_ on an input fails inside torch.export itself (a bare IndexError from its
    guards, which index the input by its new rank): the error says what the program did."""

    def fn(x):
        x.unsqueeze_(0)
        return x * 2

    with torch.no_grad(), pytest.raises(CaptureError, match="in-place op changes the number of dimensions of an input"):
        tilefuse.compile(fn, (torch.randn(3, 4),))


def test_a_write_into_a_copy_made_by_to_copy_true_is_never_the_originals():
    """`.to(dtype, copy=True)` (copy passed by position in the export) is new memory, not x."""

    def fn(x):
        y = x.to(torch.float32, copy=True)
        y.add_(1)
        return x * 1, y

    with torch.no_grad():
        try:
            prog = tilefuse.compile(fn, (torch.zeros(2, 4),))
        except CaptureError:
            return  # refused: fine, nothing is lost
        x = torch.zeros(2, 4)
        torch.testing.assert_close(prog(x), fn(torch.zeros(2, 4)))
        assert not x.any()


def test_inputs_that_share_memory_with_a_written_input_are_refused_at_the_call():
    """The Graph IR reads every input as given, so a write into an input another input views
    would be missed there: such a call is an error naming both, and the inputs are untouched."""

    def fn(a, b):
        a.add_(1)
        return b * 2

    with torch.no_grad():
        prog = tilefuse.compile(fn, (torch.randn(4, 4), torch.randn(4, 4)))
        a = torch.randn(4, 4)
        before = a.clone()
        with pytest.raises(ValueError, match="writes in place, shares memory with input"):
            prog(a, a.t())
        assert torch.equal(a, before)
        torch.testing.assert_close(prog(a, before), before * 2)
        torch.testing.assert_close(a, before + 1)
