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
