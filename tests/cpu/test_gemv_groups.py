"""Which of a program's GEMV launches run as one (runtime.runner.grouped_gemvs): consecutive
ones that read one A, none reading what an earlier one writes. The launches themselves run
on a GPU (tests/gpu/test_gemv_gpu.py); here the runner's ops are stand-ins."""
from tilefuse.codegen import gemv
from tilefuse.codegen.gemm_sm90 import GemmProblem
from tilefuse.runtime.gemv import GemvKernel
from tilefuse.runtime.runner import _Gemm, grouped_gemvs


def _gemv_op(a, b, outs, ins=(), m=4, n=64, k=64):
    """A thin-path GEMM op over environment slots: A at `a`, B at `b`, writing `outs`, reading
    `ins` (epilogue operands), run by a GEMV."""
    op = object.__new__(_Gemm)
    op.gk = GemvKernel(gemv.render(GemmProblem(m, n, k)), None, False)
    op.a, op.b, op.ashape, op.packed, op.per_call = a, b, (m, k), {}, False
    op.order = tuple((True, i, (m, n), None, None) for i in outs) + tuple((False, i, (m,), None, None) for i in ins)
    return op


def test_consecutive_gemvs_of_one_a_run_as_one():
    q, k, v = _gemv_op(0, 1, [10]), _gemv_op(0, 2, [11]), _gemv_op(0, 3, [12])
    other = object()
    got = grouped_gemvs([other, q, k, v, other], lambda run: ("group", run))
    assert got == [other, ("group", (q, k, v)), other]


def test_a_run_breaks_at_another_a_another_op_or_a_read_of_its_own_output():
    q, k = _gemv_op(0, 1, [10]), _gemv_op(0, 2, [11])
    reads_q = _gemv_op(0, 3, [12], ins=[10])        # its epilogue reads q's output
    b_is_k = _gemv_op(0, 11, [13])                  # its B is k's output
    other_a = _gemv_op(5, 4, [14])
    shape = _gemv_op(0, 6, [15], m=2)               # same slot, another shape of A
    make = lambda run: ("group", run)  # noqa: E731
    assert grouped_gemvs([q, k, reads_q], make) == [("group", (q, k)), reads_q]
    assert grouped_gemvs([q, k, b_is_k], make) == [("group", (q, k)), b_is_k]
    assert grouped_gemvs([q, other_a, k], make) == [q, other_a, k]
    assert grouped_gemvs([q, shape], make) == [q, shape]
    other = object()
    assert grouped_gemvs([q, other, k], make) == [q, other, k]


def test_only_plain_gemv_launches_join():
    from tilefuse.runtime.gemv import GemvGroupKernel

    q, k = _gemv_op(0, 1, [10]), _gemv_op(0, 2, [11])
    packed = _gemv_op(0, 3, [12])
    packed.packed = {"cos": "table"}
    grouped = _gemv_op(0, 4, [13])
    grouped.gk = GemvGroupKernel(gemv.render_group([GemmProblem(4, 64, 64), GemmProblem(4, 32, 64)]), None, False)
    make = lambda run: ("group", run)  # noqa: E731
    assert grouped_gemvs([q, packed, k], make) == [q, packed, k]
    assert grouped_gemvs([q, grouped, k], make) == [q, grouped, k]


def test_groups_are_on_unless_turned_off():
    assert gemv.groups_enabled({}) and gemv.groups_enabled({"TILEFUSE_GEMV_GROUPS": "1"})
    assert not gemv.groups_enabled({"TILEFUSE_GEMV_GROUPS": "off"})
    assert not gemv.groups_enabled({"TILEFUSE_GEMV_GROUPS": "0"})


def test_a_group_that_does_not_build_leaves_its_launches_and_says_why():
    import pytest

    q, k = _gemv_op(0, 1, [10]), _gemv_op(0, 2, [11])

    def fails(run):
        raise RuntimeError("ptxas error: too much shared data")

    with pytest.warns(UserWarning, match="2 GEMVs of one A run one by one.*too much shared data"):
        assert grouped_gemvs([q, k], fails) == [q, k]

