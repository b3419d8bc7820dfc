"""Scans (cumsum, cumprod, cummax / cummin values): a Graph IR `Scan`, a Loop IR `Scan` in the
column loop, one pass of codegen/scan.py. Checked here on the CPU: values through the Loop IR
interpreter against eager, the plan (maps before and after in the scan's kernel, PyTorch's op
where a kernel would not pay or cannot), the Loop IR rules, and the CUDA for each schedule
shape building without spills."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.check import compare, float64_reference
from tilefuse.codegen import mapreduce as mr
from tilefuse.loop import ir as L
from tilefuse.loop.canon import structural_hash
from tilefuse.loop.interp import run_kernel
from tilefuse.loop.verify import verify
from tilefuse.runtime.launch import compile_source_only


def _externs(p):
    return [s for s in p.plan.steps if s.family == "extern" and not s.view]


def _kernels(p):
    return [s for s in p.plan.steps if s.family == "mapreduce"]


FNS = {
    "cumsum": (lambda x: x.cumsum(-1), True),
    "cumprod": (lambda x: (1 + 0.1 * x).cumprod(-1), True),
    "cummax": (lambda x: torch.cummax(x, -1)[0], False),
    "cummin of a map": (lambda x: torch.cummin(x * 2 - 1, -1).values, False),
    "mask positions": (lambda x: (x > 0).cumsum(-1) - 1, False),
    "maps around": (lambda x: (x.exp() * 0.5).cumsum(-1).sqrt() + x, True),
}


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(FNS)), rows=st.integers(1, 9), cols=st.integers(1, 1100),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_scans_equal_eager_through_the_interpreter(name, rows, cols, dtype):
    """Any row length (1, odd, past a CTA's registers): one kernel, no PyTorch op, and the values
    eager gives: bit for bit where nothing rounds (max, min, an integer sum), else within the 2x
    rule of a float64 reference."""
    fn, rounds = FNS[name]
    x = torch.randn(rows, cols).to(dtype)
    p = tilefuse.compile(fn, (x,))
    assert not _externs(p) and len(_kernels(p)) <= 1, str(p.plan)
    got, want = p(x), fn(x)
    if rounds:
        chk = compare(name, got, float64_reference(fn, (x,)), want)
        assert chk.ok, chk
    else:
        assert torch.equal(got, want)


def test_a_nan_carries_on_through_a_running_max():
    """cummax: once a NaN is seen every later element is NaN, as PyTorch's."""
    x = torch.randn(3, 50)
    x[1, 7] = float("nan")
    fn = lambda x: torch.cummax(x, -1)[0]  # noqa: E731
    got, want = tilefuse.compile(fn, (x,))(x), fn(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_maps_before_and_after_the_scan_share_its_kernel():
    """cast, scale, scan, exp, add: one kernel reading x once and writing the result once."""
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    p = tilefuse.compile(lambda x: (x.float() * 2).cumsum(-1).exp().to(torch.bfloat16) + x, (x,))
    (k,) = _kernels(p)
    assert not _externs(p)
    assert k.bytes == 2 * x.numel() * 2


@pytest.mark.parametrize("fn,kernels", [
    (lambda x: x.cumsum(-1) / x.sum(-1, keepdim=True), 1),
    (lambda x: x.softmax(-1).cumsum(-1), 1),
    (lambda x: torch.cummax(F.rms_norm(x, (x.shape[-1],)), -1)[0], 1),
    (lambda x: x.cumsum(-1).amax(-1), 2),
], ids=["sum then scan", "softmax then scan", "norm then cummax", "scan then max"])
def test_reductions_before_a_scan_share_its_kernel(fn, kernels):
    """A scan's pass is the row's last: the reductions it reads (a softmax's, a norm's) are passes
    before it in one kernel; a reduction of the scan takes a kernel of its own. Eager's values."""
    x = torch.rand(8, 300)
    p = tilefuse.compile(fn, (x,))
    assert not _externs(p) and len(_kernels(p)) == kernels, str(p.plan)
    chk = compare("x", p(x), float64_reference(fn, (x,)), fn(x))
    assert chk.ok, chk


@pytest.mark.parametrize("fn,why", [
    (lambda x: x.cumsum(0), "fewer than a column kernel takes"),
    (lambda x: torch.cummax(x, 1)[1], "cummax"),
], ids=["dim 0 of few rows", "cummax indices"])
def test_what_stays_pytorchs_op(fn, why):
    """A scan along a dim with others after it over too few of those rows for a column kernel, and
    cummax's indices: PyTorch's op, named in the plan with the reason, with eager's values."""
    x = torch.randn(6, 10)
    p = tilefuse.compile(fn, (x,))
    assert any(why in s.note for s in _externs(p)), str(p.plan)
    assert torch.equal(p(x), fn(x))


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=2, max_size=4), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_scan_along_another_dim_is_a_column_kernel(shape, data, dtype):
    """Along a dim with others after it (`x.cumsum(1)` over [B, S, D]) a thread walks each row, its
    neighbours the rows beside it in memory (codegen/columns.py's layout): one kernel with the
    maps around it, eager's values."""
    import os

    d = data.draw(st.integers(0, len(shape) - 2))
    shape[-1] = max(shape[-1], 2)
    fn = lambda x: (x * 2).cumsum(d).exp() * 0.1  # noqa: E731
    x = torch.randn(shape).to(dtype)
    old = os.environ.get("TILEFUSE_COLUMN_MIN_ROWS")
    os.environ["TILEFUSE_COLUMN_MIN_ROWS"] = "1"
    try:
        p = tilefuse.compile(fn, (x,))
    finally:
        if old is None:
            del os.environ["TILEFUSE_COLUMN_MIN_ROWS"]
        else:
            os.environ["TILEFUSE_COLUMN_MIN_ROWS"] = old
    assert not _externs(p) and len(_kernels(p)) == 1, str(p.plan)
    chk = compare("column scan", p(x), float64_reference(fn, (x,)), fn(x))
    assert chk.ok, chk


def test_a_scan_of_weights_and_constants_folds():
    """A causal mask's `ones(T, T).cumsum(-1)` (and a scan of a weight) is PyTorch's op, folded into
    a weight when compiling: no kernel recomputes it per call."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            return x + torch.ones(16, 16).cumsum(-1) + self.w.cumsum(0)

    from tilefuse.graph import ir

    x, m = torch.randn(16, 16), M()
    p = tilefuse.compile(m, (x,))
    assert not _externs(p) and len(_kernels(p)) == 1, str(p.plan)
    assert not any(isinstance(n, ir.Scan) for n in p.plan.graph.nodes), str(p.plan.graph)
    with torch.no_grad():
        assert torch.allclose(p(x), m(x), rtol=1e-6, atol=1e-6)


def test_scans_can_be_left_to_pytorch(monkeypatch):
    """TILEFUSE_SCANS=0 runs every scan as PyTorch's op (an A/B switch), saying so in the plan."""
    monkeypatch.setenv("TILEFUSE_SCANS", "0")
    x = torch.randn(4, 100)
    p = tilefuse.compile(lambda x: x.cumsum(-1) * 2, (x,))
    (e,) = _externs(p)
    assert "scans are off" in e.note
    assert torch.allclose(p(x), x.cumsum(-1) * 2, rtol=1e-6, atol=1e-6)


# -- Loop IR ---------------------------------------------------------------------------------------


def _kernel(op="sum", dtype="f32", where="loop", var="c"):
    scan = L.Scan("s", op, var, "x", dtype)
    inner = (L.Load("x", "a", (L.Var("r"), L.Var("c"))), scan, L.Store("b", (L.Var("r"), L.Var("c")), "s"))
    if where == "reduce":
        inner = (L.Load("x", "a", (L.Var("r"), L.Var("c"))), scan)
        body = (L.Reduce("t", "sum", "c", 5, inner, "s", dtype), L.Store("b", (L.Var("r"), L.IConst(0)), "t"))
    else:
        body = (L.Loop("c", 5, inner),)
    return L.Kernel("k", (L.Buffer("a", (3, 5), "f32", "in"), L.Buffer("b", (3, 5), "f32", "out")),
                    (L.Loop("r", 3, body, parallel=True),))


@pytest.mark.parametrize("op,numpy", [("sum", np.cumsum), ("prod", np.cumprod),
                                      ("max", np.maximum.accumulate), ("min", np.minimum.accumulate)])
def test_the_interpreter_runs_a_scan_along_its_loop(op, numpy):
    """A Scan is its value's running op over the loop's iterations so far, this one included."""
    a = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    got = run_kernel(_kernel(op), {"a": a})["b"]
    np.testing.assert_allclose(got, numpy(a, axis=1), rtol=1e-6)


@pytest.mark.parametrize("kw,msg", [
    ({"where": "reduce"}, "runs along the loop whose body holds it"),
    ({"var": "r"}, "runs along the loop whose body holds it"),
    ({"op": "mean"}, "unknown scan"),
    ({"dtype": "f64"}, "cast it first"),
])
def test_verify_rejects_a_misplaced_or_mistyped_scan(kw, msg):
    with pytest.raises(ValueError, match=msg):
        verify(_kernel(**kw))


def test_the_structural_hash_tells_scans_apart():
    """A running sum and a running max of the same value hash differently; renamed, equal."""
    assert structural_hash(_kernel("sum")) != structural_hash(_kernel("max"))
    k = _kernel("sum")
    renamed = L.Kernel("other", k.params, tuple(_rename(s) for s in k.body))
    assert structural_hash(renamed) == structural_hash(k)


def _rename(s):
    from dataclasses import replace

    if isinstance(s, L.Loop):
        return replace(s, body=tuple(_rename(t) for t in s.body))
    if isinstance(s, L.Scan):
        return replace(s, dst="q", value="y")
    if isinstance(s, L.Load):
        return replace(s, dst="y")
    if isinstance(s, L.Store):
        return replace(s, value="q")
    return s


# -- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("fn,shape,dtype,stage", [
    (lambda x: x.cumsum(-1), (64, 4096), torch.bfloat16, "regs"),           # a row a CTA of 4 warps
    (lambda x: x.cumsum(-1) * 2, (512, 128), torch.bfloat16, "regs"),       # a row a sub-warp
    (lambda x: torch.cummax(x, -1)[0] - x, (16, 1000), torch.float32, "regs"),  # 2 rows a CTA of 2 warps each
    (lambda x: x.cumprod(-1), (5, 3), torch.float16, "regs"),               # a row a thread
    (lambda x: x.cumsum(-1), (300, 65536), torch.bfloat16, "stream"),       # tiles of 4 chunks
    (lambda x: (x > 0).cumsum(-1), (3, 65537), torch.float32, "stream"),    # i64, chunks of one element (prime: whole)
    (lambda x: x.cumsum(1) * 2, (4, 512, 4096), torch.bfloat16, "stream"),  # a column kernel, a row a thread
], ids=["cta", "subwarp", "warps", "thread", "stream", "stream-i64", "columns"])
def test_scan_kernels_build_without_spills(fn, shape, dtype, stage, arch):
    p = tilefuse.compile(fn, (torch.randn(shape, dtype=dtype),))
    (lw,) = p.kernels.values()
    src, cubin = compile_source_only(lw.kernel, arch)
    assert src.schedule.stage == stage, src.schedule
    assert cubin.info.clean, f"{arch} {src.schedule}: {cubin.info}"


def test_a_scan_refuses_schedules_its_pass_does_not_take():
    """Shared-memory staging, clusters and batches are other passes' layouts: a clear error (what
    the tuner skips), not a wrong kernel."""
    p = tilefuse.compile(lambda x: x.cumsum(-1), (torch.randn(8, 4096, dtype=torch.bfloat16),))
    (lw,) = p.kernels.values()
    for bad in (mr.MapReduceSchedule(threads=256, group=256, stage="smem"),
                mr.MapReduceSchedule(threads=256, group=256, cluster=2),
                mr.MapReduceSchedule(threads=256, group=16, batch=2)):
        with pytest.raises(ValueError, match="a scan's row is walked by one CTA"):
            mr.render(lw.kernel, bad)


def test_the_tuner_space_of_a_scan_holds_only_schedules_it_renders():
    from tilefuse.tune import mapreduce as tmr

    p = tilefuse.compile(lambda x: x.cumsum(-1), (torch.randn(8, 2048, dtype=torch.bfloat16),))
    (lw,) = p.kernels.values()
    space = tmr.space(lw.kernel)
    configs = list(space.configs())
    assert configs and all(space.as_dict(c)["stage"] in ("regs", "stream") for c in configs)


# -- few long rows ---------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(op=st.sampled_from(["cumsum", "cummax", "cummin", "mask"]), rows=st.integers(1, 3),
       cols=st.sampled_from([16384, 20000, 40000, 65536, 70001]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_few_long_rows_are_scanned_in_pieces_with_eagers_values(op, rows, cols, dtype):
    """rewrites.split_long_scans: a scan over fewer than SPLIT_SCAN_ROWS rows of 16384 or more is
    each piece's total, the totals' running value, and each piece scanned from it; the program
    computes what eager does (bit for bit for max, min and integer sums)."""
    fn = {"cumsum": lambda x: x.cumsum(-1), "cummax": lambda x: torch.cummax(x, -1)[0],
          "cummin": lambda x: torch.cummin(x * 2, -1).values, "mask": lambda x: (x > 0).cumsum(-1) - 1}[op]
    x = torch.randn(rows, cols).to(dtype)
    p = tilefuse.compile(fn, (x,))
    split = any(n.name.endswith("_pieces") for n in p.plan.graph.nodes)
    assert split == any(cols % k == 0 for k in range(256, 4097)), str(p.plan.graph)
    assert not _externs(p)
    got, want = p(x), fn(x)
    if op == "cumsum":
        chk = compare(op, got, float64_reference(fn, (x,)), want)
        assert chk.ok, chk
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("shape,env", [((300, 16384), None), ((2, 8192), None), ((2, 65536), "0")],
                         ids=["many rows", "short rows", "TILEFUSE_SPLIT=0"])
def test_scans_stay_whole(shape, env, monkeypatch):
    """Rows enough for every SM, rows shorter than SPLIT_SCAN_MIN, or splitting turned off: one
    kernel, a CTA (or fewer threads) a row."""
    if env is not None:
        monkeypatch.setenv("TILEFUSE_SPLIT", env)
    p = tilefuse.compile(lambda x: x.cumsum(-1), (torch.randn(shape),))
    assert not any(n.name.endswith("_pieces") for n in p.plan.graph.nodes)
    assert len(_kernels(p)) == 1


def test_a_prime_row_stays_whole():
    """No divisor in [256, 4096]: the row is scanned whole (streamed by one CTA), its values
    within the 2x rule (an allclose against eager's here failed now and then: the interpreter's
    float32 chain of 65537 sums is 1e-3 off near 100, and a value near 0 then fails atol)."""
    torch.manual_seed(0)
    x = torch.randn(1, 65537)
    fn = lambda x: x.cumsum(-1)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    assert len(_kernels(p)) == 1
    chk = compare("cumsum", p(x), float64_reference(fn, (x,)), fn(x))
    assert chk.ok, chk


# -- found in review -------------------------------------------------------------------------------


def test_an_inf_in_a_piece_spoils_nothing_else():
    """A split row's offsets are the running value one piece back, not the running sum less the
    piece's own (inf - inf would make the whole piece NaN): eager's infs and NaNs, no others."""
    x = torch.randn(2, 20000)
    x[0, 5], x[1, 100] = float("inf"), float("nan")
    fn = lambda x: x.cumsum(-1)  # noqa: E731
    got, want = tilefuse.compile(fn, (x,))(x), fn(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    fin = want.isfinite()
    assert torch.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fn,shape", [(lambda x: x.t().t().cumsum(-1), (3, 300)),
                                      (lambda x: x.mean(-2, keepdim=True).cumsum(-1), (6, 1, 300))],
                         ids=["permutes that cancel", "a reduction's reshape"])
def test_a_scan_whose_argument_a_rewrite_renames_compiles(fn, shape):
    """rewrites.substitute renames a scan's argument like any node's (it kept a dropped name)."""
    x = torch.randn(shape)
    assert torch.allclose(tilefuse.compile(fn, (x,))(x), fn(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [lambda x: x.to(torch.int8).cumsum(-1, dtype=torch.int8).float(),
                                lambda x: x.to(torch.int8).cumprod(-1, dtype=torch.int8) > 0,
                                lambda x: x.to(torch.uint8).cumsum(-1, dtype=torch.uint8) * 3],
                         ids=["i8 sum", "i8 prod", "u8 sum"])
def test_an_8_bit_running_sum_wraps_before_the_maps_after_it(fn):
    """Summed in 32 bits (shuffles move 32), an 8-bit scan is wrapped to its dtype where it is
    made, not only where it is stored: 100 + 100 is -56 in int8 for the maps after it too."""
    x = torch.full((2, 8), 100.0)
    assert torch.equal(tilefuse.compile(fn, (x,))(x), fn(x))


def test_scans_off_leaves_long_rows_whole_to_pytorch(monkeypatch):
    monkeypatch.setenv("TILEFUSE_SCANS", "0")
    p = tilefuse.compile(lambda x: x.cumsum(-1), (torch.randn(2, 65536),))
    assert [s.family for s in p.plan.steps] == ["extern"]


def test_a_grid_reduction_never_takes_a_scans_kernel(monkeypatch):
    """TILEFUSE_GRID_REDUCE=1 merges a row kernel with the reduction after it; not one with a
    scan (whose pass is the row's last): each kernel renders and the values are eager's."""
    monkeypatch.setenv("TILEFUSE_GRID_REDUCE", "1")
    x, w = torch.randn(64, 300), torch.randn(64)
    fn = lambda x, w: (x.cumsum(-1) * w[:, None], (w * 3).sum())  # noqa: E731
    p = tilefuse.compile(fn, (x, w))
    for lw in p.kernels.values():
        mr.render(lw.kernel)
    for got, want in zip(p(x, w), fn(x, w)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


def test_the_tuners_float64_reference_takes_a_scan():
    """tune/reference.promote_f64 widens a scan like a reduction (the tuner checks each
    candidate against it)."""
    from tilefuse.tune.reference import loop_problem, promote_f64

    p = tilefuse.compile(lambda x: (x * 2).cumsum(-1), (torch.randn(8, 512, dtype=torch.bfloat16),))
    (lw,) = p.kernels.values()
    verify(promote_f64(lw.kernel))
    assert all(s.dtype == "f64" for s in L.walk(promote_f64(lw.kernel).body) if isinstance(s, L.Scan))
    assert loop_problem(lw.kernel) is not None


def test_a_16_bit_value_scanned_is_one_value_wherever_the_kernel_uses_it():
    """`cummax(x) - x` of a bf16 map x: the scan reads x rounded to bf16 (as PyTorch holds it), and
    so does the subtraction, so it is 0 exactly where x is the running max (fuzzing: the
    subtraction read x unrounded, a 2x-rule failure on values that should be 0)."""
    x = torch.randn(6, 40).to(torch.bfloat16)
    def fn(x):
        y = x * 1.37 + 0.1
        return torch.cummax(y, -1)[0] - y

    got, want = tilefuse.compile(fn, (x,))(x), fn(x)
    assert torch.equal(got == 0, want == 0)
    chk = compare("x", got, float64_reference(fn, (x,)), want)
    assert chk.ok, chk


@pytest.mark.parametrize("fn", [lambda x: x.cumsum(-1), lambda x: x.cumprod(-1), lambda x: torch.cummax(x, -1)[0]],
                         ids=["cumsum", "cumprod", "cummax"])
def test_a_split_scan_reads_the_row_twice_and_writes_it_once(fn):
    """The pieces' scan reads the offsets (their first elements combined with them), so it runs
    in the kernel storing the result: no f32 running values of the pieces stored and read back
    (a scan of a piece alone joined the totals' kernel, and 64 x 524288 bf16 moved 402 MB)."""
    x = torch.randn(2, 65536, dtype=torch.bfloat16)
    p = tilefuse.compile(fn, (x,))
    assert any(n.name.endswith("_pieces") for n in p.plan.graph.nodes)
    moved = sum(k.bytes for k in _kernels(p))
    assert moved <= 3 * x.numel() * x.element_size() * 1.02, str(p.plan)


@pytest.mark.parametrize("fn", [
    lambda x, r, c: x.cumsum(-1) * 2,                                  # a scalar
    lambda x, r, c: torch.cummax(x, -1)[0] - x,                        # the rows themselves
    lambda x, r, c: (x.cumsum(-1) - r) * c,                            # a value a row, a value a column
    lambda x, r, c: torch.where(x.softmax(-1).cumsum(-1) < r.sigmoid(), x, 0.0),  # top-p's mask of a row
], ids=["scalar", "rows", "row and column", "mask"])
def test_maps_after_a_split_scan_run_in_its_kernel(fn):
    """rewrites.maps_below_reshapes: maps reading the split scan's result run in the pieces'
    shape, in the kernel storing it (the reshape back to rows moved below them): no kernel of
    their own reading the scan's result back; values as eager's."""
    torch.manual_seed(0)
    x, r, c = torch.randn(2, 65536), torch.randn(2, 1), torch.randn(65536)
    p = tilefuse.compile(fn, (x, r, c))
    assert any(n.name.endswith("_pieces") for n in p.plan.graph.nodes)
    last = _kernels(p)[-1]
    assert last.scan and any(n.endswith("_pieces") and n not in ("cumsum_pieces", "cummax_pieces")
                             for n in last.nodes), str(p.plan)
    assert not _externs(p)
    got, want = p(x, r, c), fn(x, r, c)
    chk = compare("out", got, float64_reference(fn, (x, r, c)), want)
    assert chk.ok, chk


@pytest.mark.parametrize("fn,xs", [
    (lambda x, o: x.cumsum(-1) + o, ((1, 16384), (3, 16384))),
    (lambda x, o: x.cumsum(-1) * o[:, :1], ((1, 16384), (3, 16384))),
    (lambda x, o: torch.where(x.cumsum(-1) > 0, o, 0.0), ((1, 16384), (3, 16384))),
    (lambda x, o: x.cumsum(-1) + o, ((2, 1, 16384), (2, 3, 16384))),
    (lambda x, o: x.cumsum(-1) + o.cumsum(-1), ((1, 16384), (3, 16384))),
], ids=["[1,C] + [3,C]", "[1,C] * [3,1]", "where into [3,C]", "[2,1,C] + [2,3,C]", "two scans"])
def test_a_map_broadcasting_a_split_scan_beyond_its_rows_stays_where_it_is(fn, xs):
    """(Found in review.) A map whose result is larger than the scan's rows was rebuilt in the
    pieces' shape, smaller than its own: a map the planner left to PyTorch, which crashed when
    called. Such maps keep their place; the program computes eager's values."""
    torch.manual_seed(0)
    xs = tuple(torch.randn(s) for s in xs)
    p = tilefuse.compile(fn, xs)
    assert not _externs(p), str(p.plan)
    chk = compare("out", p(*xs), float64_reference(fn, xs), fn(*xs))
    assert chk.ok, chk


@pytest.mark.parametrize("fn", [lambda y: y.exp() * y, lambda y: y * 2 + y, lambda y: (y > 0) & (y < 5)],
                         ids=["exp(y) * y", "y * 2 + y", "two compares"])
def test_maps_of_maps_after_a_split_scan_share_its_kernel(fn):
    """(Found in review.) A map of a map moved below the reshape read it through a reshape of its
    reshape, so both were stored and read back by a kernel of their own (7 row trips where 3
    do): each now reads the moved one's pieces."""
    torch.manual_seed(0)
    x = torch.randn(2, 65536)
    p = tilefuse.compile(lambda x: fn(x.cumsum(-1)), (x,))
    assert len(_kernels(p)) == 4, str(p.plan)
    assert sum(k.bytes for k in _kernels(p)) <= 3.05 * x.numel() * x.element_size(), str(p.plan)
    got, want = p(x), fn(x.cumsum(-1))
    if got.dtype == torch.bool:
        assert torch.equal(got, want)
    else:
        chk = compare("out", got, float64_reference(lambda x: fn(x.cumsum(-1)), (x,)), want)
        assert chk.ok, chk


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("fn,shapes", [
    (lambda a, b, c, d, e, f: (a * b + c * d + e * f).cumsum(-1), [(64, 4096)] * 6),
    (lambda a, b, c, d, e, f: (a * b + c * d + e * f).cumsum(-1), [(64, 100)] * 6),
    (lambda x, z: (x.cumsum(-1) > torch.cummax(z, -1)[0], torch.cummax(x, -1)[0]), [(2, 16384)] * 2),
], ids=["six f32 streams, long rows", "six f32 streams, short rows", "two split scans and a compare"])
def test_a_scan_of_many_streams_builds(fn, shapes, arch):
    """(Found in review.) A scan kernel staging wide streams (six f32 inputs, or f32 beside a
    bool at 16 elements a chunk) took four chunks a thread, 96 registers of row, which render
    refuses: a crash when called. It takes fewer chunks a thread now; every kernel builds clean
    and the values are eager's."""
    torch.manual_seed(0)
    xs = tuple(torch.randn(s) for s in shapes)
    p = tilefuse.compile(fn, xs)
    for lw in p.kernels.values():
        src, cubin = compile_source_only(lw.kernel, arch)
        assert cubin.info.clean, f"{arch} {src.schedule}: {cubin.info}"
    outs = [o if isinstance(o, tuple) else (o,) for o in (p(*xs), fn(*xs), float64_reference(fn, xs))]
    for got, want, ref in zip(*outs):
        if got.dtype != torch.bool:  # (a compare at the 2x rule's edge may fall either way)
            chk = compare("out", got, ref, want)
            assert chk.ok, chk


@pytest.mark.parametrize("fn,trips", [
    (lambda x: (x.cumsum(-1) * 0.01).softmax(-1), 5),
    (lambda x: (lambda y: y - y.amax(-1, keepdim=True))(x.cumsum(-1)), 5),
    (lambda x: (x.cumsum(-1) > 0).sum(-1), 4),
], ids=["softmax of it", "less its max", "a count of it"])
def test_maps_feeding_a_reduction_of_a_split_scan_stay(fn, trips):
    """(Found in review.) A map after a split scan that a reduction of the rows reads, or that
    reads one, cannot join the scan's kernel: moved, it was stored in place of the scan (an int64
    row for a count) or split a softmax into kernels of its own. Such maps keep their place:
    row-sized trips (reads and writes over the kernels) no more than before they could move."""
    torch.manual_seed(0)
    x = torch.randn(2, 16384)
    p = tilefuse.compile(fn, (x,))
    assert sum(k.bytes for k in _kernels(p)) <= (trips + 0.05) * x.numel() * x.element_size(), str(p.plan)
    got, want = p(x), fn(x)
    if got.is_floating_point():
        chk = compare("out", got, float64_reference(fn, (x,)), want)
        assert chk.ok, chk
    else:
        assert torch.equal(got, want)


def test_a_map_reading_a_map_that_stays_stays_too():
    """(Found in review.) m = y * 2 stays (a reduction reads it); m + 1 read it, moved, back from
    memory: m stored by one kernel and read by another. A map reading a map that stays stays."""
    fn = lambda x: (lambda m: (m.sum(-1), m + 1))(x.cumsum(-1) * 2)  # noqa: E731
    torch.manual_seed(0)
    x = torch.randn(2, 16384)
    p = tilefuse.compile(fn, (x,))
    assert sum(k.bytes for k in _kernels(p)) <= 5.05 * x.numel() * x.element_size(), str(p.plan)
    for got, want, ref in zip(p(x), fn(x), float64_reference(fn, (x,))):
        chk = compare("out", got, ref, want)
        assert chk.ok, chk


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("C", [100, 4096])
def test_a_scan_beside_a_bool_stream_takes_narrower_chunks(C, arch):
    """(Found in review.) A bool stream gives 16-element chunks, 32 registers of an int64 stream
    beside it: streamed one chunk a tile, it spilled. The chunk narrows until the streams take at
    most half the staged registers; the kernel builds clean and sums as eager."""
    torch.manual_seed(0)
    a, b, m = torch.randint(-5, 6, (64, C)), torch.randint(-5, 6, (64, C)), torch.randn(64, C) > 0
    fn = lambda a, b, m: torch.where(m, a, b).cumsum(-1)  # noqa: E731
    p = tilefuse.compile(fn, (a, b, m))
    for lw in p.kernels.values():
        src, cubin = compile_source_only(lw.kernel, arch)
        assert cubin.info.clean, f"{arch} {src.schedule}: {cubin.info}"
    assert torch.equal(p(a, b, m), fn(a, b, m))
