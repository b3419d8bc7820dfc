"""Partial row reductions in the GEMM epilogue, without a GPU: what the Loop IR says they
compute (the interpreter against NumPy, tails, -inf and large values), that the sm_90a
kernel renders and compiles cleanly, that its registers feed each (row, group) partial
exactly once (through the wgmma fragment), and clear refusals where it cannot run them."""
import re

import numpy as np
import pytest

from tilefuse.codegen import epilogue as epi
from tilefuse.codegen import gemm_sm80 as g80
from tilefuse.codegen import gemm_sm90 as g
from tilefuse.layout import mma
from tilefuse.loop import ir
from tilefuse.loop.interp import run_kernel
from tilefuse.runtime import nvrtc

W = epi.PARTIAL_WIDTH


def lm_head(m, n, width=W, batch=1, also_store=False) -> ir.Kernel:
    """pmax, psum (log-sum-exp partials) and psel (target select) of the logits acc."""
    e = epi.EpilogueBuilder(m, n, batch)
    x = e.acc()
    if also_store:
        e.store("logits", x, "bf16")
    e.partial_lse("pmax", "psum", x, width)
    e.partial_select("psel", x, "target", width)
    return e.kernel("lm_head_partials")


def numpy_partials(acc, target, width):
    """The definition, group by group, in float64."""
    m, n = acc.shape
    t = -(-n // width)
    pmax, psum, psel = (np.zeros((m, t)) for _ in range(3))
    for j in range(t):
        seg = acc[:, j * width:(j + 1) * width].astype(np.float64)
        pmax[:, j] = seg.max(axis=1)
        shift = np.where(pmax[:, j] == -np.inf, 0.0, pmax[:, j])
        with np.errstate(invalid="ignore"):
            psum[:, j] = np.exp(seg - shift[:, None]).sum(axis=1)
        inside = (target >= j * width) & (target < min((j + 1) * width, n))
        psel[:, j] = np.where(inside, acc[np.arange(m), np.clip(target, 0, n - 1)], 0.0)
    return pmax, psum, psel


@pytest.mark.parametrize("n", [300, 256, 100])
def test_interpreter_partials_match_numpy(n):
    """pmax/psum/psel from the interpreter equal the definition on random logits with a
    shifted row (values near 1e4), a row with -inf entries, a row whose group 1 is all -inf
    ((-inf, 0), not NaN), and targets in every group, at the tail, and in no group (-100)."""
    m = 6
    rng = np.random.default_rng(1)
    acc = (rng.standard_normal((m, n)) * 3).astype(np.float32)
    acc[1] += 1e4
    acc[2, ::7] = -np.inf
    if n > W:
        acc[3, W:2 * W] = -np.inf
    target = np.array([0, n - 1, -100, min(W, n - 1), 5, n // 2], dtype=np.int64)
    out = run_kernel(lm_head(m, n), {"acc": acc, "target": target})
    pmax, psum, psel = numpy_partials(acc, target, W)
    assert out["pmax"].shape == (m, -(-n // W))
    np.testing.assert_array_equal(out["pmax"], pmax.astype(np.float32))
    np.testing.assert_allclose(out["psum"], psum, rtol=2e-6)
    np.testing.assert_array_equal(out["psel"], psel.astype(np.float32))
    if n > W:
        assert out["pmax"][3, 1] == -np.inf and out["psum"][3, 1] == 0.0
    assert (out["psel"][2] == 0).all()  # ignore_index: in no group


def test_partials_finish_into_the_row_log_sum_exp_and_loss():
    """lse = M + log(sum_t exp(pmax_t - M) psum_t) and loss = lse - sum_t psel_t (the finishing
    reduction) give the log-sum-exp and cross-entropy of each row."""
    m, n = 5, 1000
    rng = np.random.default_rng(2)
    acc = (rng.standard_normal((m, n)) * 4).astype(np.float32)
    target = rng.integers(0, n, m)
    out = run_kernel(lm_head(m, n), {"acc": acc, "target": target})
    big = out["pmax"].max(axis=1, keepdims=True).astype(np.float64)
    lse = big[:, 0] + np.log((np.exp(out["pmax"] - big) * out["psum"]).sum(axis=1))
    a = acc.astype(np.float64)
    ref = a.max(1) + np.log(np.exp(a - a.max(1, keepdims=True)).sum(1))
    np.testing.assert_allclose(lse, ref, rtol=1e-6)
    np.testing.assert_allclose(lse - out["psel"].sum(axis=1), ref - a[np.arange(m), target], rtol=1e-5)


def test_sum_of_squares_and_max_of_a_mapped_value_with_the_tile_also_stored():
    """Partials reduce what the element chain computes (here acc + bias[n]), and an epilogue
    may store the tile as well (when something else reads it)."""
    m, n, width = 4, 200, 64
    e = epi.EpilogueBuilder(m, n)
    y = e.op("add", e.acc(), e.load("bias", "col", "f32"))
    e.store("out", y, "f32")
    e.partial_sum("sq", e.op("mul", y, y), width)
    e.partial_max("mx", y, width)
    k = e.kernel()
    rng = np.random.default_rng(3)
    acc, bias = rng.standard_normal((m, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = run_kernel(k, {"acc": acc, "bias": bias})
    yy = acc + bias
    np.testing.assert_array_equal(out["out"], yy)
    for j in range(4):
        seg = yy[:, j * width:(j + 1) * width].astype(np.float64)
        np.testing.assert_allclose(out["sq"][:, j], (seg * seg).sum(1), rtol=1e-6)
        np.testing.assert_array_equal(out["mx"][:, j], seg.max(1).astype(np.float32))


def test_batched_partials_index_the_batch():
    b, m, n = 2, 3, 130
    rng = np.random.default_rng(4)
    acc = rng.standard_normal((b, m, n)).astype(np.float32)
    target = rng.integers(0, n, (b, m))
    out = run_kernel(lm_head(m, n, batch=b), {"acc": acc, "target": target})
    for i in range(b):
        ref = numpy_partials(acc[i], target[i], W)
        np.testing.assert_array_equal(out["pmax"][i], ref[0].astype(np.float32))
        np.testing.assert_array_equal(out["psel"][i], ref[2].astype(np.float32))


def test_inner_body_and_partials_are_found():
    k = lm_head(64, 256)
    assert epi.inner_body(k) == () and not epi.is_pairwise(k)
    assert epi.partial_width(k) == W and [b.name for b in epi.partial_outputs(k)] == ["pmax", "psum", "psel"]
    k2 = lm_head(64, 256, also_store=True)
    assert any(isinstance(s, ir.Store) and s.buf == "logits" for s in epi.inner_body(k2))
    assert epi.partials_loop(epi.standard(8, 8, "bf16")) is None


SCHEDS = [g.GemmSchedule(128, 256, stages=4, tma_store=False), g.GemmSchedule(128, 128, stages=6),
          g.GemmSchedule(64, 128, stages=8, consumers=1), g.GemmSchedule(256, 128, stages=4),
          g.GemmSchedule(128, 256, stages=4, cluster_m=2)]


@pytest.mark.parametrize("sched", SCHEDS, ids=str)
@pytest.mark.parametrize("shape", [(1000, 1000), (512, 1024)], ids=["tails", "full"])
def test_partials_kernel_compiles_for_sm90a_without_spills(sched, shape):
    m, n = shape
    src = g.render(g.GemmProblem(m, n, 520, "bf16", epilogue=lm_head(m, n)), sched)
    cubin = nvrtc.compile_cuda(src.source, src.name, "sm_90a")
    assert cubin.info.clean, cubin.info
    unused = set(re.findall(r'variable "(\w+)" was declared but never referenced', cubin.log))
    assert unused <= {"stage_out", "ep_slot"}, unused  # (those two: the template's, without TMA stores)
    assert src.c_box is None  # no TMA store: the logits tile is not written at all
    assert "logits" not in src.params and set(src.params) == {"pmax", "psum", "psel", "target"}
    assert "tf_exp_fast(" in src.source  # the sum of exp(y - max) on ex2.approx, as the map-reduce LSE
    assert "__shfl_xor_sync(0xffffffffu, r0_max, 1)" in src.source


def test_partials_with_the_tile_stored_compile():
    src = g.render(g.GemmProblem(300, 384, 64, "bf16", epilogue=lm_head(300, 384, also_store=True)),
                   g.GemmSchedule(128, 128, stages=6))
    assert "logits[" in src.source
    assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean


def _coords(source: str, name: str):
    expr = re.search(rf"const int {name} = (.*?);", source).group(1).replace("/", "//")
    return lambda tid: eval(expr, {"tid": tid})


@pytest.mark.parametrize("sched", [g.GemmSchedule(128, 256), g.GemmSchedule(128, 128, stages=6),
                                   g.GemmSchedule(64, 128, consumers=1)], ids=str)
def test_rendered_partials_take_each_element_once_per_row_group(sched):
    """Read back from the rendered source: each (row r, group g) block's registers, over the 128
    threads of each consumer warpgroup, are exactly the tile elements of row r whose column is
    in group g, each once, at the (row, col) the wgmma fragment gives that (thread, register);
    the lanes holding a (row, group) are one quad, which the xor-1/xor-2 shuffles span."""
    p = g.GemmProblem(4 * sched.bm, 4 * sched.bn, 64, epilogue=lm_head(4 * sched.bm, 4 * sched.bn))
    src = g.render(p, sched).source
    part = src[src.index("reduce max c in"):]  # after the partials header comment
    frag_row, frag_col = _coords(src, "frag_row"), _coords(src, "frag_col")
    frag = mma.sm90_64xN_c(sched.bn)
    # the select's body names each register's column (it compares it with the target)
    blocks = re.findall(r"const int m = row_base \+ (\d+) \+ frag_row \+ (\d+);\n.*?"
                        r"const int grp = tn \* (\d+) \+ (\d+);\n.*?// %r1 = reduce sum(.*?)if \(", part, re.S)
    assert len(blocks) == sched.rows_per_wg // 64 * 2 * (sched.bn // W)
    seen = {}
    for mb_off, r, per_tile, grp, body in blocks:
        assert int(per_tile) == sched.bn // W
        regs = re.findall(r"const int n = col_base \+ frag_col \+ (\d+);\n\s*const float \w+ = acc\[(\d+)\]\[(\d+)\];",
                          body)
        assert len(regs) == body.count("acc[")
        assert regs
        for tid in range(128):
            for cc, mb, v in regs:
                row = int(mb_off) + frag_row(tid) + int(r)
                col = frag_col(tid) + int(cc)
                assert int(mb) * 64 == int(mb_off)
                assert frag(tid, int(v)) == (frag_row(tid) + int(r), col)
                assert col // W == int(grp), f"column {col} reduced into group {grp}"
                assert (row, col) not in seen, f"{(row, col)} reduced twice"
                seen[(row, col)] = tid
    assert set(seen) == {(r, c) for r in range(sched.rows_per_wg) for c in range(sched.bn)}
    for (row, col), tid in seen.items():  # the threads of one (row, group): one quad
        quad = {seen[(row, c)] >> 2 for c in range(col // W * W, (col // W + 1) * W)}
        assert len(quad) == 1


@pytest.mark.parametrize("bn", [64, 128, 256])
@pytest.mark.parametrize("width", [8, 64, 128])
def test_fragment_quads_cover_each_row_group_once(bn, width):
    """partial_quads (what the renderer checks before it relies on xor shuffles): every element
    of the 64 x bn accumulator in one (row, group), held by the four lanes of one quad."""
    if bn % width:
        with pytest.raises(g.GemmError):
            g.partial_quads(mma.sm90_64xN_c(bn), width)
        return
    owners = g.partial_quads(mma.sm90_64xN_c(bn), width)
    assert len(owners) == 64 * (bn // width)
    assert sum(len(v) for v in owners.values()) == 64 * bn
    for (row, grp), held in owners.items():
        assert len({t >> 2 for t, _ in held}) == 1
        assert len(held) == width


def test_tile_width_must_hold_whole_groups():
    p = g.GemmProblem(512, 1024, 64, epilogue=lm_head(512, 1024))
    with pytest.raises(g.GemmError, match="bn a multiple of 128"):
        g.render(p, g.GemmSchedule(128, 64, stages=8))
    for m, n in [(64, 128), (128, 4096), (8192, 32000), (1000, 50257)]:
        s = g.default_schedule(g.GemmProblem(m, n, 64, epilogue=lm_head(m, n)))
        assert s.bn % W == 0, s


def test_sm80_declines_partial_reductions():
    p = g.GemmProblem(256, 256, 64, epilogue=lm_head(256, 256))
    with pytest.raises(g.GemmError, match="sm_90a template only"):
        g80.render(p)


def test_partials_of_a_pairwise_epilogue_are_refused():
    e = epi.EpilogueBuilder(8, 16, pairwise=True)
    with pytest.raises(ValueError, match="pairwise"):
        e.partial_sum("s", e.acc(0), 8)


def test_a_partial_indexing_with_c_otherwise_is_refused():
    """The template binds c only through the group's column t * W + c (a register's n)."""
    m, n = 128, 256
    acc = ir.Buffer("acc", (m, n), "f32", "in")
    out = ir.Buffer("s", (m, 2), "f32", "out")
    bad = ir.Reduce("r", "sum", "c", W, (ir.Load("x", "acc", (ir.Var("m"), ir.Var("c"))),), "x", "f32")
    body = ir.Loop("m", m, (ir.Loop("t", 2, (bad, ir.Store("s", (ir.Var("m"), ir.Var("t")), "r")), parallel=True),),
                   parallel=True)
    k = ir.Kernel("bad", (acc, out), (body,), family="epilogue")
    with pytest.raises(g.GemmError, match="indexes with c"):
        g.render(g.GemmProblem(m, n, 64, epilogue=k), g.GemmSchedule(128, 256))


def with_sq(m, n, operand="residual", width=W, also_max=False):
    """y = acc + residual[m, n] (or + bias[n]) stored as bf16, and sum(y * y) per group."""
    e = epi.EpilogueBuilder(m, n)
    y = e.op("add", e.acc(), e.load(operand, "tile" if operand == "residual" else "col", "bf16"))
    e.store("out", y, "bf16")
    e.partial_sum("sq", e.op("mul", y, y), width)
    if also_max:
        e.partial_max("mx", y, width)
    return e.kernel(f"{operand}_sq")


def test_inline_partials_bind_the_element_values_and_decline_a_shifted_sum():
    """A sum of squares and a max need nothing between the reductions: the element code can add
    them up, every statement of their bodies a copy of an element statement (only the masks of
    a short last group are their own). The LM head's sum of exp(y - max) needs the group's max
    first: no."""
    for n, masks in [(1024, 0), (1000, 5)]:
        p = g.GemmProblem(256, n, 64, epilogue=with_sq(256, n, also_max=True))
        inl = g.inline_partials(p, p.epilogue)
        assert inl is not None and [r.op for r in inl.reds] == ["sum", "max"]
        for red, twins, rest in zip(inl.reds, inl.twins, inl.rest):
            assert len(twins) + len(rest) == len(red.body)
            assert len(rest) == masks, rest
            loads = [x.dst for x in red.body if isinstance(x, ir.Load)]
            assert loads and set(loads) <= set(twins), "the residual and acc are the element's own reads"
    p = g.GemmProblem(256, 1000, 64, epilogue=lm_head(256, 1000, also_store=True))
    assert g.inline_partials(p, p.epilogue) is None
    p = g.GemmProblem(256, 1024, 64, epilogue=lm_head(256, 1024))
    assert g.inline_partials(p, p.epilogue) is None, "no element code to put them in"


INLINE_SCHEDS = [g.GemmSchedule(128, 256, stages=3, cluster_m=2, tma_loads=True), g.GemmSchedule(128, 128, stages=6),
                 g.GemmSchedule(128, 256, stages=4, tma_store=False), g.GemmSchedule(64, 128, stages=8, consumers=1),
                 g.GemmSchedule(128, 128, stages=6, pingpong=True), g.GemmSchedule(128, 128, stages=6, split_k=2)]


def _adds(src: str):
    """(acc block mb, register v, partial register (i, mb, r, g)) for each term added, read in
    source order: a register's term follows its `acc[mb][v]` read."""
    out, cur = [], None
    for line in src.splitlines():
        a = re.search(r"= acc\[(\d+)\]\[(\d+)\];", line)
        if a:
            cur = (int(a.group(1)), int(a.group(2)))
        b = re.search(r"^\s*pp(\d+)_(\d+)_(\d+)_(\d+) = ", line)
        if b and "__shfl" not in line:
            out.append((cur, tuple(int(x) for x in b.groups())))
    return out


@pytest.mark.parametrize("sched", INLINE_SCHEDS, ids=str)
@pytest.mark.parametrize("operand", ["residual", "bias"])
def test_inline_partials_take_each_register_once_into_its_row_group(sched, operand):
    """Read back from the rendered source: every accumulator register (mb, v) adds one term to
    each partial, into the register of its own 64-row block, row (frag row 0 or 8) and column
    group (the wgmma fragment's); the residual is read once per element (from its TMA slot or
    one pair load), not again for the partials; the tile keeps its TMA store where the
    schedule has one."""
    m, n = 2 * sched.span[0], 2 * sched.span[1]
    p = g.GemmProblem(m, n, 128, epilogue=with_sq(m, n, operand, also_max=True))
    src = g.render(p, sched)
    frag = mma.sm90_64xN_c(sched.bn)
    adds = _adds(src.source)
    want = {(mb, v) for mb in range(sched.rows_per_wg // 64) for v in range(frag.values)}
    for i in (0, 1):
        mine = [(reg, key) for reg, key in adds if key[0] == i]
        assert sorted(reg for reg, _ in mine) == sorted(want), f"partial {i}: each register once"
        for (mb, v), (_, pmb, r, grp) in mine:
            row, col = frag(0, v)
            assert (pmb, r, grp) == (mb, row, col // W)
    code = src.source.split("#define BM")[1]  # (after the header comments)
    assert "reduce sum c in" not in code, "no partials loop re-rendered"
    if operand == "residual":
        reads = len(re.findall(r"\(residual \+|residual\[", code)) + len(re.findall(r"tf_lds32\(slot", code))
        assert reads == (sched.rows_per_wg // 64) * frag.values // 2, "one read per register pair"
    assert (src.c_box is not None) == sched.tma_store


@pytest.mark.parametrize("shape", [(1000, 1000, 136), (8192, 2048, 2048), (300, 384, 64)])
@pytest.mark.parametrize("operand", ["residual", "bias"])
def test_inline_partials_compile_without_spills_on_every_store_path(shape, operand):
    m, n, k = shape
    p = g.GemmProblem(m, n, k, epilogue=with_sq(m, n, operand, also_max=True))
    for sched in INLINE_SCHEDS + [None]:
        try:
            src = g.render(p, sched)
        except g.GemmError as e:
            assert "split_k" in str(e) and k < 128, e  # only K too short to split
            continue
        info = nvrtc.compile_cuda(src.source, src.name, "sm_90a").info
        assert info.clean, (src.schedule, info)


def test_inline_partials_keep_the_plain_default_schedule():
    """Beside the element code the partials cost the residual GEMM ~0.5% (bench/LOG_gemm.md,
    s18): the default is the plain epilogue's, cluster and residual by TMA included."""
    m, n, k = 8192, 2048, 2048
    plain = g.default_schedule(g.GemmProblem(m, n, k, epilogue=epi.standard(m, n, "bf16", residual=True)))
    s = g.default_schedule(g.GemmProblem(m, n, k, epilogue=with_sq(m, n)))
    assert s == plain and s.cluster_m == 2 and s.tma_loads and s.tma_store
    lm = g.default_schedule(g.GemmProblem(m, 32000, k, epilogue=lm_head(m, 32000)))
    assert not lm.tma_store, "the loop form (no element code) keeps the partials' own default"
