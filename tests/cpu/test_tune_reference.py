"""The references a candidate schedule is checked against (tune/reference.py).

- A row-sampled kernel computes exactly the rows it samples of the whole kernel (the same
  interpreter, bit for bit), the last row among them.
- The f64-promoted kernel matches PyTorch in float64 on the fixtures.
- LoopProblem.check passes the interpreter's own output and fails a perturbed output, an
  unwritten (NaN) element and a wrong integer.
- Integer inputs used as indices are drawn inside the dimension they index.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import loop_fixtures as fx  # noqa: E402

from tilefuse.loop.interp import run_kernel  # noqa: E402
from tilefuse.tensors import to_torch  # noqa: E402
from tilefuse.tune import reference as rf  # noqa: E402

NAMES = ["rmsnorm", "softmax", "cross_entropy", "layernorm", "add_rmsnorm", "map", "gather"]


@pytest.mark.parametrize("name", NAMES)
def test_a_sampled_kernel_computes_exactly_its_rows_of_the_whole(name):
    k = getattr(fx, f"{name}_kernel")(203, 96, "bf16")
    inputs = rf.make_inputs(k, seed=5)
    sampled, rows = rf.sample_rows(k, 16)
    assert len(rows) == 16 and rows[-1] == 202 and len(set(rows)) == 16
    whole, part = run_kernel(k, inputs), run_kernel(sampled, inputs)
    for b in k.outputs:
        np.testing.assert_array_equal(part[b.name], whole[b.name][rows])


def test_small_kernels_are_not_sampled():
    assert rf.sample_rows(fx.softmax_kernel(64, 96, "bf16"), 64) is None


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("name", NAMES)
def test_the_promoted_kernel_is_pytorchs_float64_answer(name, dtype):
    ex = fx.example(name, 9, 200, dtype, seed=11)
    ours = run_kernel(rf.promote_f64(ex.kernel), ex.inputs)
    ref64 = fx.torch_outputs(ex)[1]
    for n, a in ours.items():
        np.testing.assert_allclose(a.astype(np.float64), ref64[n], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["rmsnorm", "cross_entropy", "add_rmsnorm"])
def test_check_passes_the_interpreter_and_fails_wrong_answers(name):
    k = getattr(fx, f"{name}_kernel")(150, 128, "bf16")
    p = rf.loop_problem(k, seed=2, sample=32)
    assert p.rows is not None and len(p.rows) == 32
    good = {n: to_torch(a) for n, a in run_kernel(k, p.inputs).items()}
    assert p.check(good) is None
    for n in good:
        off = dict(good, **{n: good[n].float().mul(1.02).to(good[n].dtype)})
        assert "wrong result" in p.check(off) and n in p.check(off)
        hole = dict(good, **{n: good[n].clone()})
        hole[n].view(-1)[-1] = float("nan")  # the last row is always checked
        assert "NaN" in p.check(hole)


def test_integer_outputs_must_match_exactly():
    from tilefuse.loop.ir import Buffer, Kernel, Load, Loop, Store, Var

    k = Kernel("copy_ids", (Buffer("ids", (100, 8), "i64", "in"), Buffer("out", (100, 8), "i64", "out")),
               (Loop("r", 100, (Loop("c", 8, (Load("x", "ids", (Var("r"), Var("c"))),
                                                 Store("out", (Var("r"), Var("c")), "x"))),), parallel=True),))
    p = rf.loop_problem(k, sample=10)
    good = to_torch(run_kernel(k, p.inputs)["out"])
    assert p.check({"out": good}) is None
    bad = good.clone()
    bad[-1, 0] += 1
    assert "wrong result" in p.check({"out": bad})


def test_index_inputs_stay_inside_what_they_index():
    k = fx.gather_kernel(400, 64, "bf16", V=11)
    table = [b for b in k.inputs if b.dtype == "bf16"][0]
    ids = [b for b in k.inputs if b.dtype != "bf16"][0]
    assert rf.index_bounds(k) == {ids.name: table.shape[0]}
    x = rf.make_inputs(k, seed=3)[ids.name]
    assert x.min() >= 0 and x.max() < table.shape[0] and len(np.unique(x)) > 1
