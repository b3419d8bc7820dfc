"""`.T`, `.mT`, `.mH` and `.adjoint()` reach torch.export as ops of their own (aten.numpy_T,
aten.mT, ...), not as transpose: each must lower to the same permute view as `.t()`, so
x @ w.T is one GEMM reading w in place (N-major B), with no extern copy before it."""
import pytest
import torch

import tilefuse


@pytest.mark.parametrize("spell", ["T", "mT", "mH", "adjoint", "t"])
def test_every_transpose_spelling_is_a_view_the_gemm_reads_in_place(spell):
    flip = {"T": lambda w: w.T, "mT": lambda w: w.mT, "mH": lambda w: w.mH,
            "adjoint": lambda w: w.adjoint(), "t": lambda w: w.t()}[spell]
    torch.manual_seed(0)
    x, w = torch.randn(24, 40, dtype=torch.bfloat16), torch.randn(56, 40, dtype=torch.bfloat16)
    fn = lambda x, w: torch.relu(x @ flip(w))  # noqa: E731
    prog = tilefuse.compile(fn, (x, w))
    families = [s.family for s in prog.plan.steps if s.family != "alias"]
    assert families == ["gemm"], str(prog.plan)
    assert "B [N,K]" in str(prog.plan), str(prog.plan)  # w read where it lies, K-major
    ref = torch.relu(x.float() @ w.float().T)
    torch.testing.assert_close(prog(x, w).float(), ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))


def test_numpy_T_reverses_every_dim_and_mT_only_the_last_two():
    torch.manual_seed(1)
    a = torch.randn(3, 5, 7)
    for fn in (lambda a: a.T * 2.0, lambda a: a.mT + 1.0, lambda a: a.mH - 1.0):
        prog = tilefuse.compile(fn, (a,))
        assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
        got = prog(a)
        assert got.shape == fn(a).shape
        torch.testing.assert_close(got, fn(a))


def test_mT_of_a_vector_is_refused_as_pytorch_refuses_it():
    with pytest.raises(Exception):
        tilefuse.compile(lambda v: v.mT * 2.0, (torch.randn(5),))


def _lowered(prog):
    return [s.note for s in prog.plan.steps if s.family == "extern" and not s.view]


@pytest.mark.parametrize("name, fn, shapes", [
    ("reshape_as", lambda x, y: x.reshape_as(y) * y, [(6, 8), (4, 12)]),
    ("view_as", lambda x, y: x.view_as(y) + 1.0, [(6, 8), (48,)]),
    ("swapdims", lambda x: x.swapdims(0, 1) * 2.0, [(5, 7)]),
    ("moveaxis", lambda x: x.moveaxis(0, -1) - 1.0, [(3, 5, 7)]),
    ("ravel", lambda x: x.ravel().exp(), [(5, 7)]),
    ("linalg_norm", lambda x: torch.linalg.norm(x, dim=-1), [(9, 33)]),
    ("absolute+negative", lambda x: x.absolute() + x.negative(), [(9, 33)]),
    ("true_divide", lambda x, y: torch.true_divide(x, y.abs() + 1.0), [(9, 33), (9, 33)]),
    ("diff", lambda x: x.diff(dim=-1), [(9, 33)]),
])
def test_a_composite_op_without_a_translator_lowers_through_its_decomposition(name, fn, shapes):
    """torch.export keeps CompositeImplicitAutograd ops whole; each one here decomposes into ops
    tilefuse lowers, so the program runs with no extern, equal to eager."""
    torch.manual_seed(2)
    ins = tuple(torch.randn(s) for s in shapes)
    prog = tilefuse.compile(fn, ins)
    assert _lowered(prog) == [], str(prog.plan)
    torch.testing.assert_close(prog(*ins), fn(*ins), rtol=1e-5, atol=1e-5)


def test_inner_and_tensordot_decompose_into_one_gemm_each():
    torch.manual_seed(3)
    x, w = torch.randn(24, 40, dtype=torch.bfloat16), torch.randn(56, 40, dtype=torch.bfloat16)
    for fn in (lambda x, w: torch.inner(x, w), lambda x, w: torch.tensordot(x, w, dims=([1], [1]))):
        prog = tilefuse.compile(fn, (x, w))
        assert [s.family for s in prog.plan.steps if s.family not in ("alias",) and not s.view] == ["gemm"], \
            str(prog.plan)
        ref = x.float() @ w.float().T
        torch.testing.assert_close(prog(x, w).float(), ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))


def test_a_composite_reaching_an_op_tilefuse_does_not_lower_stays_one_extern_named_as_written():
    """cdist decomposes into ops of which one has no translator: the user sees aten.cdist, not
    a piece of its decomposition."""
    x, y = torch.randn(6, 8), torch.randn(5, 8)
    prog = tilefuse.compile(lambda x, y: torch.cdist(x, y) * 2.0, (x, y))
    assert _lowered(prog) == ["tilefuse does not lower aten.cdist"], str(prog.plan)
    torch.testing.assert_close(prog(x, y), torch.cdist(x, y) * 2.0)


def test_a_decomposed_op_keeps_the_users_line():
    """The decomposition's ops carry no stack trace of their own: each takes the line of the op
    it came from (take_along_dim -> gather), which errors and bounds checks name."""
    from tilefuse.graph import ir
    x, i = torch.randn(8, 16), torch.randint(0, 16, (8, 1))
    prog = tilefuse.compile(lambda x, i: torch.take_along_dim(x, i, 1) * 2.0, (x, i))
    (gather,) = [n for n in prog.graph.nodes if isinstance(n, ir.Gather)]
    assert "test_transpose_spellings.py" in gather.source and "take_along_dim" in gather.source, gather.source
    torch.testing.assert_close(prog(x, i), torch.take_along_dim(x, i, 1) * 2.0)
