"""The sm_80 GEMM template without a GPU.

* Its layouts (tilefuse.layout) are what the hardware needs: the accumulator and copy
  fragments cover their tiles exactly once, each ldmatrix row is 16 contiguous aligned
  bytes, and the rendered index expressions are the layouts' functions at every thread.
* The rendered kernel, executed index by index in Python (every cp.async, every ldmatrix
  with the PTX ISA's register semantics, every mma.sync with the PTX ISA's fragment
  layouts, every epilogue store), computes A @ B exactly on small-integer inputs, tails,
  batches, both B layouts and every copy width included: the test's oracle is the ISA,
  written out below, not the layouts under test.
* Knob instantiations compile for sm_80 (and sm_90a) with no spills; shared-memory
  accesses are bank-conflict free; bad problems and knobs get clear errors.
"""
import re

import numpy as np
import pytest

from tilefuse.codegen import epilogue as epi
from tilefuse.codegen import gemm_sm80 as g
from tilefuse.codegen.gemm_sm90 import GemmError, GemmProblem
from tilefuse.layout import wavefronts
from tilefuse.runtime import nvrtc
from tilefuse.runtime.gemm_sm80 import _arch

S = g.Sm80Schedule


# ---------------------------------------------------------------- a tiny evaluator of the printed C


def _py(expr: str):
    """A printed C integer expression as Python code (non-negative operands: / is //)."""
    e = re.sub(r"\b(\d+)(?:u|LL)\b", r"\1", expr)
    e = re.sub(r"(?<![/])/(?![/])", "//", e)
    e = e.replace("&&", " and ").replace("||", " or ").replace("true", "True")
    return compile(e, "<c>", "eval")


def _ev(code, env):
    return eval(code, {"__builtins__": {}, "min": min}, env)  # noqa: S307 - our own generated arithmetic


def _assignments(text: str):
    """[(name, code)] of each `const <type> name = expr;` line, in order."""
    return [(m.group(1), _py(m.group(2)))
            for m in re.finditer(r"^\s*const (?:int|unsigned|long long) (\w+) = (.*?);\s*$", text, re.M)]


class _Idx:
    """blockIdx stand-in."""

    def __init__(self, x, y):
        self.x, self.y = x, y


class Kernel:
    """The pieces of a rendered kernel, parsed back from its source."""

    def __init__(self, src: g.Sm80Source):
        self.src = src
        self.defines = {k: int(v) for k, v in re.findall(r"^#define (\w+) (\d+)$", src.source, re.M)}
        text = src.source.split('extern "C"')[1]
        head, rest = text.split("auto load_tile", 1)
        lam, rest = rest.split("};", 1)
        self.batch_a = int(re.search(r"A \+= batch \* (\d+)LL;", head).group(1))
        self.batch_b = int(re.search(r"B \+= batch \* (\d+)LL;", head).group(1))
        self.setup = _assignments(head.split("int t = blockIdx.x;")[1])
        self.copies = []
        for block in re.findall(r"\{\s*(const long long gmn.*?)\n\s*\}", lam, re.S):
            gmn = _py(re.search(r"gmn = (.*?);", block).group(1))
            gk = _py(re.search(r"gk = (.*?);", block).group(1))
            ok = _py(re.search(r"ok = (.*?);", block).group(1))
            op, goff = re.search(r"src = ([AB]) \+ \(ok \? (.*?) : 0\);", block).groups()
            m = re.search(r"tf_cp_async(\d+)\((st_[ab]) \+ (.*?), src", block)
            if m:
                nbytes, base, dst = int(m.group(1)), m.group(2), m.group(3)
            else:
                base, dst = re.search(r"tf_st_shared_u16\((st_[ab]) \+ (.*?), ok", block).groups()
                nbytes = 2
            self.copies.append((op, gmn, gk, ok, _py(goff), base, _py(dst), nbytes // 2))
        loop = rest.split("const unsigned sa =")[1].split("if (++rd")[0]
        self.steps = []
        for line in loop.strip().splitlines()[1:]:
            line = line.strip()
            m = re.match(r"tf_ldsm_x4(_trans)?\(([ab])f\[(\d)\]\[(\d+)\], s[ab] \+ (.*)\);", line)
            if m:
                self.steps.append(("ldsm", bool(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)),
                                   _py(m.group(5))))
                continue
            m = re.match(r"tf_mma\(acc \+ (\d+), af\[(\d)\]\[(\d+)\], bf\[(\d)\]\[(\d+)\] \+ (\d)\);", line)
            assert m, f"unexpected main-loop line {line!r}"
            self.steps.append(("mma", *map(int, m.groups())))
        epilogue = rest.split("tf_cp_wait<0>();")[1]
        self.frag = _assignments(epilogue.split("{")[0])
        self.stores = [(_py(mm), _py(nn), int(v)) for mm, nn, v in re.findall(
            r"const int m = (.*?);\s*const int n = (.*?);.*?acc\[(\d+)\]", epilogue, re.S)]

    def thread_env(self, tid, bid, batch=0):
        env = dict(self.defines, tid=tid, t=bid, blockIdx=_Idx(bid, batch))
        for name, code in self.setup:
            env[name] = _ev(code, env)
        for name, code in self.frag:
            env[name] = _ev(code, env)
        return env


# ---------------------------------------------------------------- the PTX ISA, written out (the oracle)


def _ldmatrix(rows_of, trans):
    """ldmatrix.x4: rows_of[lane] = the 8 elements at lane's row address (lanes 8j..8j+7
    give matrix j's rows). Returns regs[lane][j] = (lo, hi) per PTX: without .trans thread
    t gets row t//4, columns 2(t%4), +1 of each matrix; with .trans the transpose."""
    regs = []
    for t in range(32):
        rj = []
        for j in range(4):
            mat = [rows_of[8 * j + r] for r in range(8)]
            g_, q = t // 4, t % 4
            rj.append((mat[g_][2 * q], mat[g_][2 * q + 1]) if not trans else (mat[2 * q][g_], mat[2 * q + 1][g_]))
        regs.append(rj)
    return regs


def _mma(acc, a_regs, b_regs):
    """mma.m16n8k16.row.col per the PTX ISA fragment figures; acc[lane] is 4 floats."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))  # K x N
    for t in range(32):
        g_, q = t // 4, t % 4
        a = [x for pair in a_regs[t] for x in pair]
        for i in range(8):
            A[g_ + 8 * ((i // 2) % 2), 2 * q + (i % 2) + 8 * (i // 4)] = a[i]
        b = [x for pair in b_regs[t] for x in pair]
        for i in range(4):
            B[2 * q + (i % 2) + 8 * (i // 2), g_] = b[i]
    D = A @ B
    for t in range(32):
        g_, q = t // 4, t % 4
        for i in range(4):
            acc[t][i] += D[g_ + 8 * (i // 2), 2 * q + (i % 2)]


def _simulate(src: g.Sm80Source, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Run the rendered kernel's index arithmetic over the whole grid; return the output
    with NaN where nothing was stored (a stored element twice is an assertion)."""
    k = Kernel(src)
    P, s = src.problem, src.schedule
    af, bf = a.reshape(-1), b.reshape(-1)
    out = np.full((P.batch, P.m, P.n), np.nan)
    a_words = s.bm * s.bk
    k_iters = -(-P.k // s.bk)
    tiles = set()
    for batch in range(P.batch):
        for bid in range(src.grid[0]):
            envs = [k.thread_env(tid, bid, batch) for tid in range(s.threads)]
            tiles.add((batch, envs[0]["tm"], envs[0]["tn"]))
            acc = np.zeros((s.threads, s.acc_regs))
            for kt in range(k_iters):
                smem = np.full(a_words + s.bn * s.bk, np.nan)
                written = np.zeros(smem.size, bool)
                for env in envs:
                    env["k0"] = kt * s.bk
                    for op, gmn, gk, ok, goff, base, dst, vec in k.copies:
                        env["gmn"], env["gk"] = _ev(gmn, env), _ev(gk, env)
                        okv = _ev(ok, env)
                        d = _ev(dst, env)
                        assert d % (2 * vec) == 0, "copy destination not aligned to its width"
                        w = d // 2 + (a_words if base == "st_b" else 0)
                        flat, boff = (af, batch * k.batch_a) if op == "A" else (bf, batch * k.batch_b)
                        g0 = boff + _ev(goff, env)
                        assert not written[w:w + vec].any(), f"shared element {w} written twice"
                        written[w:w + vec] = True
                        smem[w:w + vec] = flat[g0:g0 + vec] if okv else 0
                assert written.all(), "a shared-memory element of the stage was never written"
                regs = {}
                for warp in range(s.warps):
                    lanes = envs[32 * warp:32 * warp + 32]
                    for step in k.steps:
                        if step[0] == "ldsm":
                            _, trans, which, buf, i, addr = step
                            base = 0 if which == "a" else a_words
                            rows = []
                            for env in lanes:
                                byte = _ev(addr, env)
                                assert byte % 16 == 0, "ldmatrix row address not 16-byte aligned"
                                rows.append(smem[base + byte // 2: base + byte // 2 + 8])
                            regs[(warp, which, buf, i)] = _ldmatrix(rows, trans)
                        else:
                            _, v, abuf, ai, bbuf, bp, boff = step
                            bregs = [r[boff:boff + 2] for r in regs[(warp, "b", bbuf, bp)]]
                            sub = [acc[32 * warp + t, v:v + 4] for t in range(32)]
                            _mma(sub, regs[(warp, "a", abuf, ai)], bregs)
            for tid, env in enumerate(envs):
                for mm, nn, v in k.stores:
                    m_, n_ = _ev(mm, env), _ev(nn, env)
                    if m_ < P.m and n_ < P.n:
                        assert np.isnan(out[batch, m_, n_]), f"({m_}, {n_}) stored twice"
                        out[batch, m_, n_] = acc[tid, v]
    want = {(bt, tm, tn) for bt in range(P.batch) for tm in range(-(-P.m // s.bm)) for tn in range(-(-P.n // s.bn))}
    assert tiles == want, "the grid does not visit every output tile exactly once"
    return out


SIM_CASES = [
    # (m, n, k, b_major, batch, schedule): tails in M, N and K; each copy width (K or N odd/even)
    (70, 52, 40, "K", 1, S(32, 32, 16, 2, 1, 2, group_m=2)),
    (70, 52, 40, "N", 1, S(32, 32, 16, 2, 1, 2, group_m=2)),
    (33, 40, 37, "K", 1, S(32, 32, 16, 3, 1, 2)),          # K odd: element copies for A and B
    (33, 42, 38, "N", 1, S(32, 32, 16, 3, 1, 2)),          # K = 2 mod 4, N = 2 mod 4: 4-byte copies
    (20, 36, 44, "N", 2, S(32, 32, 16, 2, 1, 2)),          # batched; K = 4 mod 8 (8-byte copies)
    (64, 64, 96, "K", 1, S(64, 64, 32, 3, 2, 2)),
    (64, 128, 64, "N", 1, S(64, 128, 64, 2, 2, 2)),
    (1, 1, 8, "K", 1, S(32, 32, 16, 2, 1, 2)),
]


@pytest.mark.parametrize("m,n,k,b_major,batch,sched", SIM_CASES, ids=lambda x: str(x) if not isinstance(x, S) else "")
def test_rendered_kernel_computes_the_product_index_by_index(m, n, k, b_major, batch, sched):
    """Executing the printed copy / ldmatrix / mma / store indices with the ISA's semantics
    gives exactly A @ B (small integers: exact in f32 and here), every element stored once."""
    rng = np.random.default_rng(m * 1000 + n + k)
    lead = (batch,)
    a = rng.integers(-3, 4, lead + (m, k)).astype(np.float64)
    b = rng.integers(-3, 4, lead + ((n, k) if b_major == "K" else (k, n))).astype(np.float64)
    src = g.render(GemmProblem(m, n, k, "bf16", b_major=b_major, batch=batch,
                               epilogue=epi.standard(m, n, "f32", batch=batch)), sched)
    out = _simulate(src, a, b)
    bt = np.swapaxes(b, -1, -2) if b_major == "K" else b
    np.testing.assert_array_equal(out, a @ bt)


# ---------------------------------------------------------------- layouts


LAYOUT_SCHEDULES = [S(128, 128, 32, 4, 2, 2), S(128, 256, 32, 3, 2, 4), S(128, 128, 64, 3, 2, 2),
                    S(64, 64, 32, 4, 2, 2), S(64, 128, 16, 4, 1, 4)]


@pytest.mark.parametrize("sched", LAYOUT_SCHEDULES, ids=str)
@pytest.mark.parametrize("b_major", ["K", "N"])
def test_fragments_cover_their_tiles_exactly_once(sched, b_major):
    """acc: (tid, register) -> every (row, col) of the BM x BN tile once; copies: every
    element of each stage once; ldmatrix rows: each warp reads its rows x all of BK once."""
    lay = g.layouts(GemmProblem(1024, 1024, 1024, b_major=b_major), sched)

    def cells(frag, tids):
        return [frag(t, v) for t in tids for v in range(frag.values)]

    T = range(sched.threads)
    acc = cells(lay.acc, T)
    assert sorted(acc) == [(r, c) for r in range(sched.bm) for c in range(sched.bn)]
    for frag, rows in ((lay.copy_a, sched.bm), (lay.copy_b, sched.bn)):
        assert sorted(cells(frag, T)) == [(r, c) for r in range(rows) for c in range(sched.bk)]
    for w in range(sched.warps):
        wm, wn = w % sched.warps_m, w // sched.warps_m
        a = cells(lay.ldsm_a, range(32 * w, 32 * w + 32))
        assert sorted(a) == [(wm * sched.warp_m_tile + r, c) for r in range(sched.warp_m_tile) for c in range(sched.bk)]
        b = cells(lay.ldsm_b, range(32 * w, 32 * w + 32))
        assert sorted(b) == [(wn * sched.warp_n_tile + r, c) for r in range(sched.warp_n_tile) for c in range(sched.bk)]


@pytest.mark.parametrize("sched", LAYOUT_SCHEDULES, ids=str)
@pytest.mark.parametrize("b_major", ["K", "N"])
def test_printed_indices_are_the_layouts(sched, b_major):
    """Every per-thread index line of the source is the layout's function at every thread,
    and every register's constant offset is acc(tid, v) - acc(tid, 0)."""
    src = g.render(GemmProblem(1024, 1024, 1024, b_major=b_major), sched)
    lay = src.layouts
    k = Kernel(src)
    for tid in range(sched.threads):
        env = k.thread_env(tid, 0)
        assert (env["frag_row"], env["frag_col"]) == lay.acc(tid, 0)
        assert (env["a_mn"], env["a_k"]) == lay.copy_a(tid, 0)
        assert (env["b_mn"], env["b_k"]) == lay.copy_b(tid, 0)
        assert env["a_st"] == 2 * lay.smem_a(*lay.copy_a(tid, 0))
        assert env["b_st"] == 2 * lay.smem_b(*lay.copy_b(tid, 0))
        assert env["a_ld"] == 2 * lay.smem_a(*lay.ldsm_a(tid, 0))
        assert env["b_ld"] == 2 * lay.smem_b(*lay.ldsm_b(tid, 0))
        for step in k.steps:
            if step[0] == "ldsm":
                _, _, which, _, i, addr = step
                smem, frag = (lay.smem_a, lay.ldsm_a) if which == "a" else (lay.smem_b, lay.ldsm_b)
                # which (i, kk) this load is: the source lists them i fastest per kk
                hits = [v for v in range(0, frag.values, 8) if 2 * smem(*frag(tid, v)) == _ev(addr, env)]
                assert hits, f"ldmatrix address of thread {tid} is no row of the {which} fragment"
        for mm, nn, v in k.stores:
            r, c = lay.acc(tid, v)
            assert (_ev(mm, env), _ev(nn, env)) == (r, c)  # row_base = col_base = 0 for tile 0


def test_all_address_steps_are_constants_for_the_default_tiles():
    """No thread recomputes a swizzled address per k-slice: each step is base ^ x + y."""
    for sched in LAYOUT_SCHEDULES:
        for b_major in "KN":
            lay = g.layouts(GemmProblem(4096, 4096, 4096, b_major=b_major), sched)
            steps = (list(lay.steps_ldsm_a.values()) + list(lay.steps_ldsm_b.values())
                     + list(lay.steps_copy_a) + list(lay.steps_copy_b))
            assert None not in steps, (sched, b_major)


@pytest.mark.parametrize("sched", LAYOUT_SCHEDULES, ids=str)
@pytest.mark.parametrize("b_major", ["K", "N"])
def test_shared_memory_accesses_are_bank_conflict_free(sched, b_major):
    """ldmatrix: each phase (8 lanes, one 16-byte row each) is one wavefront; 16-byte
    cp.async stores: each phase of 8 threads is one wavefront."""
    lay = g.layouts(GemmProblem(4096, 4096, 4096, b_major=b_major), sched)
    for smem, frag in ((lay.smem_a, lay.ldsm_a), (lay.smem_b, lay.ldsm_b)):
        for w in range(sched.warps):
            for v in range(0, frag.values, 8):
                for ph in range(4):
                    addrs = [2 * smem(*frag(t, v)) for t in range(32 * w + 8 * ph, 32 * w + 8 * ph + 8)]
                    assert wavefronts(addrs, 16) == 1, (frag.name, w, v, ph)
    for smem, frag in ((lay.smem_a, lay.copy_a), (lay.smem_b, lay.copy_b)):
        for v in range(0, frag.values, 8):
            for t0 in range(0, sched.threads, 8):
                assert wavefronts([2 * smem(*frag(t, v)) for t in range(t0, t0 + 8)], 16) == 1


def test_copy_width_follows_the_row_length():
    """16-byte copies when rows are multiples of 8 elements, then 8, 4 and 2 bytes."""
    assert [g.vector_width(x) for x in (4096, 4100, 4098, 4097)] == [8, 4, 2, 1]
    lay = g.layouts(GemmProblem(100, 98, 37, b_major="N"), S(64, 64, 32, 2, 2, 2))
    assert (lay.vec_a, lay.vec_b) == (1, 2)


# ---------------------------------------------------------------- compiling


KNOBS = [S(128, 128, 32, 4, 2, 2), S(128, 256, 32, 3, 2, 4), S(256, 128, 32, 3, 4, 2),
         S(128, 128, 64, 3, 2, 2), S(64, 128, 32, 4, 2, 2), S(64, 64, 32, 4, 2, 2), S(64, 64, 16, 6, 2, 2)]


@pytest.mark.parametrize("sched", KNOBS, ids=str)
@pytest.mark.parametrize("b_major", ["K", "N"])
def test_knob_instantiations_compile_for_sm80_without_spills(sched, b_major):
    ep = epi.standard(1000, 1024, "bf16", bias="col", activation="gelu", residual=True)
    src = g.render(GemmProblem(1000, 1024, 520, "bf16", b_major=b_major, epilogue=ep), sched)
    cubin = nvrtc.compile_cuda(src.source, src.name, "sm_80")
    assert cubin.info.clean, cubin.info
    assert src.smem_bytes <= g.smem_limit("sm_80")


@pytest.mark.parametrize("k,b_major", [(37, "K"), (38, "N"), (36, "K")])
def test_narrow_copies_compile_without_spills(k, b_major):
    """Odd and 2/4-byte-aligned rows (element stores, 4- and 8-byte cp.async), f16."""
    src = g.render(GemmProblem(300, 130, k, "f16", b_major=b_major))
    assert (src.align_a, src.align_b) == (2 * g.vector_width(k), 2 * g.vector_width(k if b_major == "K" else 130))
    assert nvrtc.compile_cuda(src.source, src.name, "sm_80").info.clean


def test_default_schedule_compiles_for_hopper_too():
    """The same source runs on sm_90a (mma.sync is there too); its smem limit is larger."""
    src = g.render(GemmProblem(4096, 4096, 4096), None, "sm_90a")
    assert nvrtc.compile_cuda(src.source, src.name, "sm_90a").info.clean


def test_epilogue_kinds_compile():
    """GLU (pairwise), the standard epilogue with a row scale, and a custom two-output
    epilogue (pre-activation and activation) built with EpilogueBuilder."""
    m, n = 300, 256
    e = epi.EpilogueBuilder(m, n)
    x = e.op("add", e.acc(), e.load("bias", "col", "bf16"))
    e.store("pre", x, "bf16")
    e.store("out", e.op("relu", x), "f32")
    two = e.kernel("two_outputs")
    for ep in (epi.glu(m, n, "bf16"), epi.standard(m, n, "f16", row_scale=True, activation="silu"), two):
        dtype = "f16" if ep.name == "epilogue" and ep.outputs[0].dtype == "f16" else "bf16"
        src = g.render(GemmProblem(m, n, 136, dtype, epilogue=ep))
        assert nvrtc.compile_cuda(src.source, src.name, "sm_80").info.clean, ep.name
    glu = g.render(GemmProblem(m, n, 136, epilogue=epi.glu(m, n, "bf16")))
    assert "out[(m) * 128LL + (n)]" in glu.source and not glu.pair_store


def test_default_schedule_fills_the_gpu():
    assert g.default_schedule(GemmProblem(4096, 4096, 4096)) == S(128, 128, 32, 4, 2, 2)
    small = g.default_schedule(GemmProblem(512, 1024, 4096))
    assert -(-512 // small.bm) * -(-1024 // small.bn) >= 0.9 * 132 or small == S(64, 64, 32, 4, 2, 2)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, match", [
    (dict(bm=96, warps_m=4), "bm=96"), (dict(bn=40), "bn=40"), (dict(bk=48), "bk=48"),
    (dict(stages=1), "stages"), (dict(bm=256, bn=256), "accumulator"), (dict(warps_m=8, warps_n=4), "warps"),
])
def test_bad_knobs_are_refused(kwargs, match):
    with pytest.raises(GemmError, match=match):
        S(**kwargs)


def test_too_much_shared_memory_for_the_arch_is_refused():
    big = S(128, 256, 64, 4, 2, 4)   # 196 KB: fits an H100, not an A100 or an sm_86 part
    g.render(GemmProblem(512, 512, 512), big, "sm_90a")
    with pytest.raises(GemmError, match="sm_80 allows"):
        g.render(GemmProblem(512, 512, 512), big, "sm_80")


def test_tile_too_small_for_its_threads_is_refused():
    with pytest.raises(GemmError, match="do not split over 256 threads"):
        g.render(GemmProblem(64, 64, 64), S(64, 64, 16, 2, 2, 4))


def test_epilogue_shape_mismatch_is_refused():
    with pytest.raises(GemmError, match="acc"):
        g.render(GemmProblem(64, 64, 64, epilogue=epi.standard(64, 32, "bf16")))


def test_archs_before_ampere_are_refused():
    with pytest.raises(GemmError, match="sm_80 or later"):
        _arch("sm_75")
    assert _arch("sm_86") == "sm_86" and _arch("sm_90") == "sm_90a"
