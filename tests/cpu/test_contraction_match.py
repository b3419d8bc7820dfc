"""contraction.match: what a GEMM step takes into itself."""
import torch

import tilefuse
from tilefuse.check import compare, float64_reference


def test_a_transpose_read_as_both_operands_stays_a_value_of_its_own():
    """`t @ t` with t = m.T: B reads m under the transpose (K-major), but A reads t itself, so
    the transpose is not absorbed into the GEMM: it was, nothing made it, and the program
    failed reading an empty A (fuzzing). The result passes the 2x rule."""
    def f(c):
        t = (c.transpose(-1, -2) @ c).swapaxes(0, -1)
        return t @ t

    c = (torch.randn(1, 16) * 0.3).half()
    prog = tilefuse.compile(f, [c])
    (spec,) = [lw.spec for lw in prog.gemms.values()]
    assert spec.b_major == "K" and spec.a not in spec.absorbed, spec
    check = compare("t @ t", prog(c), float64_reference(f, [c]), f(c))
    assert check.ok, check
