"""RoPE's angle tables read as 16-byte words from a column-permuted copy (gemm_sm90.packed_tables,
pack_table): which epilogues take it, that each thread's element reads the table entry the
epilogue indexes, and that the kernels compile clean for sm_90a."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from tilefuse.codegen import epilogue as epi
from tilefuse.codegen import gemm_sm90 as g
from tilefuse.layout import mma
from tilefuse.runtime import nvrtc


def _rope(m, n, table=(4096, 64), dtype="bf16"):
    return g.GemmProblem(m, n, 2048, epilogue=epi.rope(m, n, "bf16", table_dtype=dtype, table=table))


@pytest.mark.parametrize("w", [32, 64, 128])
def test_pack_table_puts_each_quad_threads_pairs_side_by_side(w):
    """Thread t of a quad holds pairs t, t + 4, t + 8, ... of a row: packed, its k-th is at
    t * W/4 + k, and the packing only permutes each row's columns."""
    t = torch.randn(5, w)
    p = g.pack_table(t, w)
    for thread in range(4):
        for k in range(w // 4):
            assert torch.equal(p[:, thread * w // 4 + k], t[:, thread + 4 * k])
    assert torch.equal(p.sort(dim=1).values, t.sort(dim=1).values) and p.is_contiguous()


@pytest.mark.parametrize("bn, w", [(256, 64), (128, 64), (256, 32), (256, 128), (128, 32)])
def test_each_element_reads_the_entry_its_epilogue_indexes(bn, w):
    """For every thread of the warpgroup and every register pair of the C fragment, the packed
    position the kernel reads (segment t * W/4, value (cc / 8) mod W/4) holds the frequency
    (n mod W) that the epilogue reads at that pair, for tiles at several column offsets."""
    frag = mma.sm90_64xN_c(bn)
    freq = g.pack_table(torch.arange(w).reshape(1, w), w)[0]
    for col_base in (0, bn, 5 * bn):
        for tid in range(128):
            for v in range(0, frag.values, 2):
                r, col = frag(tid, v)
                _, cc = frag(0, v)
                n2 = (col_base + col) // 2
                pos = (w // 4) * (tid % 4) + (cc // 8) % (w // 4)
                assert int(freq[pos]) == n2 % w


def test_llama_shaped_rope_reads_both_tables_packed():
    src = g.render(_rope(8192, 2048))
    assert src.packed_tables == (("cos", 64), ("sin", 64))
    # two 16-byte words per row and table, no 2-byte table loads left
    code = "\n".join(line for line in src.source.splitlines() if not line.startswith("//"))
    assert code.count("__ldg((const uint4*)(cos") == 4 and "cos[" not in code and "sin[" not in code


@pytest.mark.parametrize("why, problem, sched", [
    ("a table as wide as the output's pairs", g.GemmProblem(512, 512, 64, epilogue=epi.rope(512, 512, "bf16", table_dtype="bf16")), None),
    ("f32 tables", _rope(512, 512, dtype="f32"), None),
    ("48 frequencies (not a multiple of 32)", _rope(512, 384, table=(256, 48)), None),
    ("a tile of 64 pairs over 128 frequencies", _rope(512, 512, table=(256, 128)), g.GemmSchedule(128, 128)),
    ("tail tiles", _rope(500, 512), None),
    ("direct stores", _rope(512, 512), g.GemmSchedule(128, 256, tma_store=False)),
    ("no pairwise rotation", g.GemmProblem(512, 512, 64, epilogue=epi.standard(512, 512, "bf16", row_scale=True)), None),
])
def test_tables_stay_unpacked_where_the_reads_do_not_fit(why, problem, sched):
    src = g.render(problem, sched)
    assert src.packed_tables == (), why
    assert "uint4*)(cos" not in src.source, why


@pytest.mark.parametrize("sched", [g.GemmSchedule(128, 256, cluster_m=2), g.GemmSchedule(128, 128, stages=6),
                                   g.GemmSchedule(128, 256, defer_stores=False),
                                   g.GemmSchedule(128, 128, stages=4, pingpong=True)])
def test_packed_table_kernels_compile_for_sm90a_without_spills(sched):
    src = g.render(_rope(1024, 1024, table=(512, 64)), sched)
    assert src.packed_tables == (("cos", 64), ("sin", 64))
    cubin = nvrtc.compile_cuda(src.source, src.name, "sm_90a")
    assert cubin.info.clean, cubin.info
    assert "C7508" not in cubin.log, "setmaxnreg ignored"


def test_the_interpreter_and_the_packed_reads_agree_on_a_whole_tile():
    """Emulate the kernel's reads for one 128 x 256 tile: every output pair's (cos, sin), taken
    from the packed tables at the kernel's positions, is the pair the epilogue program reads."""
    s, w, bn = 4096, 64, 256
    rng = np.random.default_rng(0)
    cos = torch.from_numpy(rng.standard_normal((s, w)).astype(np.float32))
    packed = g.pack_table(cos, w)
    frag = mma.sm90_64xN_c(bn)
    tm, tn = 37, 3
    for c in range(2):
        for tid in range(128):
            for v in range(0, frag.values, 2):
                r, col = frag(tid, v)
                _, cc = frag(0, v)
                m = tm * 128 + c * 64 + r
                n2 = (tn * bn + col) // 2
                got = packed[m % s, (w // 4) * (tid % 4) + (cc // 8) % (w // 4)]
                assert got == cos[m % s, n2 % w]


def test_schedule_knobs_do_not_change_which_tables_pack():
    base = _rope(8192, 2048)
    for sched in (g.default_schedule(base), replace(g.default_schedule(base), stages=3)):
        assert g.packed_tables(base, sched, base.out_epilogue)


def _two_reads(second_col):
    """A rotation reading `cos` twice: at (m % S, n % W) and at (m % S, second_col)."""
    from tilefuse.loop import ir

    m, n, s, w = 512, 512, 256, 64
    e = epi.EpilogueBuilder(m, n, 1, pairwise=True)
    x0, x1 = e.acc(0), e.acc(1)
    at = (ir.IBin("%", ir.Var("m"), ir.IConst(s)), ir.IBin("%", ir.Var("n"), ir.IConst(w)))
    c = e.load_at("cos", (s, w), "bf16", at)
    c2 = e.load_at("cos", (s, w), "bf16", (at[0], second_col))
    sn = e.load_at("sin", (s, w), "bf16", at)
    e.store("out", e.op("sub", e.op("mul", x0, c), e.op("mul", x1, sn)), "bf16", pair=0)
    e.store("out", e.op("add", e.op("mul", x0, sn), e.op("mul", x1, c2)), "bf16", pair=1)
    return g.GemmProblem(m, n, 256, epilogue=e.kernel("two_reads"))


def test_a_table_read_twice_at_its_index_is_packed_once_and_one_read_elsewhere_keeps_it_unpacked():
    """Every read of a packed table must take the packed positions: a second read at the same
    index is packed with it (listed once, so it is permuted once), a read at another column
    keeps the whole table in place."""
    from tilefuse.loop import ir

    sched = g.GemmSchedule(128, 128)
    same = g.render(_two_reads(ir.IBin("%", ir.Var("n"), ir.IConst(64))), sched)
    assert same.packed_tables == (("cos", 64), ("sin", 64))
    other = g.render(_two_reads(ir.IBin("%", ir.IBin("+", ir.Var("n"), ir.IConst(1)), ir.IConst(64))), sched)
    assert other.packed_tables == (("sin", 64),)
    code = "\n".join(line for line in other.source.splitlines() if not line.startswith("//"))
    assert "cos[" in code and "uint4*)(cos" not in code
