"""A gather whose table is a view PyTorch would copy (a slice, an expand, a roll) reads the
tensor under the view where it lies (fusion._Planner.gathers_in, loop/lower.py emit_gather
through loop/views.py): `F.pad(x[:, 8:], ...)`, `t[:64][ids]` are one kernel each, where they
were a copy in PyTorch and a torch.gather. Under a transposing permute (`F.embedding(ids, w.t())`)
the gather would read an element at a time across rows, so PyTorch copies the view and the
kernel gathers from the copy: one extern, where there were two. Values equal eager's (the
interpreter runs the Loop IR); each kernel builds without spills."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.runtime.launch import compile_source_only

CASES = {
    "rows of a slice": (lambda t, i: t[:64][i] * 2, lambda: (torch.randn(128, 64), torch.randint(0, 64, (32,)))),
    "pad of a transpose": (lambda x: F.pad(x.transpose(0, 1), (0, 8)) * 2, lambda: (torch.randn(64, 128),)),
    "flip of a slice": (lambda x: x[:, 8:].flip(-1) * 2, lambda: (torch.randn(64, 128),)),
    "embedding of a transpose": (lambda w, i: F.embedding(i, w.t()) * 2,
                                 lambda: (torch.randn(64, 100), torch.randint(0, 100, (32,)))),
    "pad of a slice": (lambda x: F.pad(x[:, 8:], (0, 8)) * 3, lambda: (torch.randn(64, 128),)),
    "replicate pad of a roll": (lambda x: F.pad(x.roll(3, -1), (2, 5), mode="replicate") + 1,
                                lambda: (torch.randn(5, 9, 40),)),
    "index_select of an expand": (lambda x, i: x.expand(4, 6, 33).index_select(1, i) * 2,
                                  lambda: (torch.randn(1, 6, 33), torch.randint(0, 6, (9,)))),
    "gather of a 3-d permute": (lambda x, i: torch.gather(x.permute(2, 0, 1), 2, i) - 1,
                                lambda: (torch.randn(7, 5, 3), torch.randint(0, 5, (3, 7, 4)))),
}


TRANSPOSED = ("pad of a transpose", "embedding of a transpose", "gather of a 3-d permute")


def _extern_steps(p):
    return [s for s in p.plan.steps if s.family == "extern" and not s.view]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_a_gather_of_a_view_is_one_kernel_equal_to_eager(name, dtype):
    fn, make = CASES[name]
    torch.manual_seed(0)
    ins = tuple(x.to(dtype) if x.is_floating_point() else x for x in make())
    p = tilefuse.compile(fn, ins)
    copies = ["permute"] if name in TRANSPOSED else []
    assert [p.graph[s.nodes[0]].op for s in _extern_steps(p)] == copies, str(p.plan)
    assert [s.family for s in p.plan.steps if s.family not in ("alias", "extern")] == ["mapreduce"], str(p.plan)
    got, want = p(*ins), fn(*ins)
    assert got.shape == want.shape and torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("name", CASES)
def test_gather_of_view_kernels_build_without_spills(name, arch):
    fn, make = CASES[name]
    ins = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in make())
    p = tilefuse.compile(fn, ins)
    for lw in p.kernels.values():
        src, cubin = compile_source_only(lw.kernel, arch)
        assert cubin.info.clean, f"{arch} {src.schedule}: {cubin.info}"


def test_a_pad_of_a_slice_reads_whole_chunks_in_vector_loads():
    """The slice's start joins the pad's column offset (codegen/mapreduce.py _val_plus): chunks
    inside the row are one 16-byte load each."""
    x = torch.randn(64, 4096, dtype=torch.bfloat16)
    p = tilefuse.compile(lambda x: F.pad(x[:, 8:], (0, 8)) * 3, (x,))
    (lw,) = p.kernels.values()
    src, _ = compile_source_only(lw.kernel, "sm_90a")
    assert "q = (long long)c0 + 8;" in src.source and "q >= 8 && q <= 4088" in src.source, src.source


def test_a_view_another_op_needs_copied_stays_copied_and_the_gather_reads_the_copy():
    """cumsum (PyTorch's) reads the slice too: its copy is made once, and the pad's kernel
    reads that copy as its table."""
    x = torch.randn(16, 40)
    fn = lambda x: (torch.cumsum(x[:, 8:], -1), F.pad(x[:, 8:], (1, 1)) * 2)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    for got, want in zip(p(x), fn(x)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_result_view_used_as_a_table_gives_eagers_values():
    x = torch.randn(12, 40)
    fn = lambda x: (x.t(), F.pad(x.t(), (0, 4)) * 2, x[:, 3:].flip(-1))  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    for got, want in zip(p(x), fn(x)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fn,make", [
    (lambda x: F.pad(x[:, 4:].reshape(10, 40), (8, 8)) * 2, lambda: (torch.randn(20, 24),)),
    (lambda x, i: x[:, 4:].reshape(10, 40)[:, i], lambda: (torch.randn(20, 24), torch.randint(0, 40, (7,)))),
    (lambda x, i: F.embedding(i, x[:, 4:].reshape(40, 10)), lambda: (torch.randn(20, 24), torch.randint(0, 40, (9,)))),
    (lambda x: x[:, 4:].reshape(-1).flip(0), lambda: (torch.randn(20, 24),)),
    (lambda x: x[2:, :].reshape(-1).flip(0), lambda: (torch.randn(20, 24),)),
    (lambda x: x[:, 4:].expand(3, 20, 20).reshape(60, 20).flip(0), lambda: (torch.randn(20, 24),)),
    (lambda x: F.pad(x.reshape(4, 5, 24)[:, :, 8:].reshape(20, 16), (8, 8)), lambda: (torch.randn(20, 24),)),
], ids=["pad", "index", "embedding", "flip", "flip rows", "flip expand", "pad of reshapes"])
def test_a_table_read_through_a_reshape_of_a_dropped_copy_reads_the_root(fn, make):
    """The kernel's table is found where it reads it (a reshape above the copied view, the name
    Step.reads holds), not at the view Step.tables names: bound to that view, whose copy was
    dropped, the table was a tensor nothing wrote (review of session 65)."""
    torch.manual_seed(2)
    ins = make()
    p = tilefuse.compile(fn, ins)
    assert torch.equal(p(*ins), fn(*ins))


def test_index_range_walks_a_shared_operand_once():
    """Each node's range is computed once: i = min(i + 1, i) eighteen times took a million
    walks (4 s) without the memo."""
    import time

    def fn(x):
        i = torch.arange(x.shape[-1])
        for _ in range(24):
            i = torch.minimum(i + 1, i)
        return x[:, i] * 2

    x = torch.randn(4, 16)
    t0 = time.perf_counter()
    p = tilefuse.compile(fn, (x,))
    assert time.perf_counter() - t0 < 30
    assert torch.equal(p(x), fn(x))


# ---------------------------------------------------------------- random view chains

VIEW_OPS = ("slice_last", "slice_first", "transpose", "roll", "expand", "reshape")


def _view(x, op, k):
    if op == "slice_last" and x.shape[-1] > 2:
        return x[..., k % 2: x.shape[-1] - 1]
    if op == "slice_first" and x.shape[0] > 2:
        return x[1 + k % 2:]
    if op == "transpose" and x.dim() >= 2:
        return x.transpose(0, -1)
    if op == "roll":
        return x.roll(k % 5 - 2, -1)
    if op == "expand" and x.dim() == 2:
        return x[None].expand(2, *x.shape)
    if op == "reshape" and x.dim() == 3:
        return x.reshape(x.shape[0] * x.shape[1], x.shape[2])
    return x


def _reader(x, kind, i):
    if kind == "pad":
        return F.pad(x, (i % 3, 8 - i % 3)) * 2
    if kind == "replicate":
        return F.pad(x if x.dim() >= 2 else x[None], (1 + i % 2, 2), mode="replicate") + 1
    if kind == "flip":
        return x.flip(-1) - 1
    return x.index_select(-1, torch.arange(x.shape[-1] - 1, -1, -2)) * 3  # (an index the kernel reads)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(3, 9), cols=st.integers(3, 20),
       chain=st.lists(st.tuples(st.sampled_from(VIEW_OPS), st.integers(0, 9)), min_size=1, max_size=3),
       kind=st.sampled_from(["pad", "replicate", "flip", "index_select"]), i=st.integers(0, 9))
def test_random_view_chains_read_by_a_gather_equal_eager(rows, cols, chain, kind, i):
    """Any chain of slices, transposes, rolls, expands and reshapes under a pad, flip or
    index_select: the plan (the copy dropped or kept) computes eager's values."""
    def fn(x):
        for op, k in chain:
            x = _view(x, op, k)
        return _reader(x, kind, i)

    x = torch.randn(rows, cols)
    p = tilefuse.compile(fn, (x,))
    assert torch.equal(p(x), fn(x)), str(p.plan)
