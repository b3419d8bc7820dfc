"""A gather whose table is a view PyTorch would copy (a slice, an expand, a roll) reads the
tensor under the view where it lies (fusion._Planner.gathers_in, loop/lower.py emit_gather
through loop/views.py): `F.pad(x[:, 8:], ...)`, `t[:64][ids]` are one kernel each, where they
were a copy in PyTorch and a torch.gather. Under a transposing permute (`F.embedding(ids, w.t())`)
the gather would read an element at a time across rows, so PyTorch copies the view and the
kernel gathers from the copy: one extern, where there were two. Values equal eager's (the
interpreter runs the Loop IR); each kernel builds without spills."""
from __future__ import annotations

import pytest
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
