"""What ptxas made of the GEMV (runtime.sass: nvdisasm on the cubin), where the source says
too little. Session 51 found that ptxas moves non-coherent (.nc, __ldg) loads across
griddepcontrol.wait (ACQBULK in SASS) both ways: the weight's first loads, written before it,
went after it (no overlap with the kernel before), and once those were coherent, some of A's
__ldg loads went above it, reading another kernel's output before it was written."""
import pytest

from tilefuse.codegen import epilogue as epi, gemv
from tilefuse.codegen.gemm_sm90 import GemmProblem
from tilefuse.runtime import nvrtc, sass

pytestmark = pytest.mark.skipif(not sass.available(), reason="no nvdisasm (pip install nvidia-cuda-nvdisasm)")


def _ops(problem, sched=None, arch="sm_90a"):
    src = gemv.render(problem, sched, arch)
    return src, sass.opcodes(sass.disassemble(nvrtc.compile_cuda(src.source, src.name, arch).data))


def _loads_before_wait(ops):
    wait = ops.index("ACQBULK")
    return [op for op in ops[:wait] if op.startswith("LDG")]


SHAPES = [(4096, 4096), (1024, 4096), (4096, 11008), (2048, 2048), (11264, 2048), (2048, 5632), (1000, 2056),
          (33, 72), (4097, 4104)]


@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("ep", ["plain", "glu", "bias_residual"])
def test_only_a_weights_first_step_is_issued_before_the_wait(n, k, ep):
    """Where B is a weight, the vectors of its first whole step (unroll x cols a lane, where K
    holds one) are loaded before ACQBULK, on the coherent path; nothing else is (A and the
    epilogue's operands may be the kernel before's outputs). (2048 x 2048 and 1000 x 2056 had
    an A load above the wait.)"""
    if ep == "glu" and n % 2:
        pytest.skip("a pairwise epilogue needs an even N")
    kernel = {"plain": lambda: None, "glu": lambda: epi.glu(1, n, "bf16"),
              "bias_residual": lambda: epi.standard(1, n, "bf16", bias="col", residual=True, row_scale=True)}[ep]()
    src, ops = _ops(GemmProblem(1, n, k, "bf16", epilogue=kernel, b_const=True))
    s = src.schedule
    early = _loads_before_wait(ops)
    whole = k // 8 >= 32 * s.unroll
    assert early == ["LDG.E.NA.128"] * (s.unroll * s.cols if whole else 0), ops[:ops.index("ACQBULK") + 1]


def test_nothing_is_loaded_before_the_wait_where_b_is_not_a_weight():
    _, ops = _ops(GemmProblem(1, 4096, 4096, "bf16", b_const=False))
    assert _loads_before_wait(ops) == []


@pytest.mark.parametrize("b_const", [False, True])
def test_the_tensor_core_form_loads_nothing_before_its_wait(b_const):
    """Not even a weight: its first step loaded early made a 4-sequence decode step 12% slower
    on an H200 and spilled one schedule (session 53)."""
    _, ops = _ops(GemmProblem(4, 4096, 4096, "bf16", b_const=b_const))
    assert _loads_before_wait(ops) == [] and any(op.startswith("HMMA") for op in ops)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_the_tensor_core_forms_l2_prefetches_stay_before_its_wait(prefetch):
    """The bulk prefetches into L2 written before the wait are issued before ACQBULK (they hold
    no register while in flight), and still no load is."""
    problem = GemmProblem(4, 4096, 11008, "bf16", b_const=True)
    _, ops = _ops(problem, gemv.MmaGemvSchedule(16, 2, prefetch))
    wait = ops.index("ACQBULK")
    assert ops[:wait].count("UBLKPF.L2") >= prefetch and _loads_before_wait(ops) == [], ops[:wait + 1]
    assert "UBLKPF.L2" in ops[wait:]  # and ahead of the loads in the main loop
    # a warp-uniform address: no loop over the lanes' addresses (a vote for the next one) around it
    _, plain = _ops(problem, gemv.MmaGemvSchedule(16, 2))
    assert ops.count("VOTEU.ANY") == plain.count("VOTEU.ANY"), [op for op in ops if op.startswith("VOTEU")]


@pytest.mark.parametrize("m", [1, 4])
def test_a_groups_members_each_load_only_their_weight_before_their_wait(m):
    """In a group (render_group) each member keeps its own wait: before each ACQBULK only that
    member's weight loads are issued (the FMA form's first step, at M = 1; none at M = 4), as
    when it runs alone."""
    ps = [GemmProblem(m, n, 4096, "bf16", b_const=True) for n in (4096, 1024, 1024)]
    src = gemv.render_group(ps)
    ops = sass.opcodes(sass.disassemble(nvrtc.compile_cuda(src.source, src.name, "sm_90a").data))
    waits = [i for i, op in enumerate(ops) if op == "ACQBULK"]
    assert len(waits) == 3
    s = src.schedule
    early = ["LDG.E.NA.128"] * (s.unroll * s.cols) if m == 1 else []
    for wait in waits:  # a member's code before its wait: back to the end of the one before (EXIT)
        start = max([i + 1 for i, op in enumerate(ops[:wait]) if op.startswith("EXIT")], default=0)
        assert [op for op in ops[start:wait] if op.startswith("LDG")] == early, ops[start:wait + 1]


def test_opcodes_reads_predicated_and_plain_instructions():
    text = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 EXIT ;
        /*0020*/               @P1 LDG.E.NA.128.CONSTANT R12, desc[UR6][R46.64] ;
        /*0030*/                   HMMA.16816.F32.BF16 R28, R28, R32, RZ ;
    """
    assert sass.opcodes(text) == ["LDC", "EXIT", "LDG.E.NA.128.CONSTANT", "HMMA.16816.F32.BF16"]
