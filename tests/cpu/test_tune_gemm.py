"""The GEMM family in the tuner (tune/gemm.py), on a CPU.

- Every candidate of small problems renders (the code generator accepts it), renders a
  kernel no other candidate does, and the heuristic default is one of them; on the issue's
  large shapes (too many candidates to render all in CI) every admitted candidate respects
  the template's budgets (shared memory, accumulator registers, BM = 64 x rows x consumers)
  and an evenly spread sample of them renders.
- Knobs round-trip to GemmSchedule; unknown knobs are a ValueError.
- Problems equal up to names share a cache key; shape, dtype, layout, batch or epilogue
  change it.
- The reference check passes a right product (with and without an epilogue) and fails a
  wrong block, an unwritten row, a NaN.
- The whole measure path, with a fake CPU "kernel" that has bugs for chosen knobs: the
  tuner fails those candidates with their reasons and picks among the rest.
- Compile-ahead: candidates compiled in other processes reach the measurement, and a
  candidate that does not compile fails with the compiler's reason.
- `tuned_gemm_schedule` (the planner's lookup) returns the cached knobs on the GPU model
  they were tuned on, for renamed problems too, and None without a GPU.
"""
from __future__ import annotations

import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import loop_fixtures as fx  # noqa: E402
import tune_fakes  # noqa: E402
from test_tune_tuner import H100, InlinePool  # noqa: E402

from tilefuse.codegen import epilogue as epi  # noqa: E402
from tilefuse.codegen import gemm_sm90 as g  # noqa: E402
from tilefuse.loop.canon import canonicalize  # noqa: E402
from tilefuse.tune import device as tdevice  # noqa: E402
from tilefuse.tune import gemm as tg  # noqa: E402
from tilefuse.tune import lookup  # noqa: E402
from tilefuse.tune.cache import Entry, TuneCache, key_for  # noqa: E402
from tilefuse.tune.families import _FAMILIES, get_family  # noqa: E402
from tilefuse.tune.measure import measure  # noqa: E402
from tilefuse.tune.tuner import TuneOptions, Tuner  # noqa: E402

GEMM = get_family(tg.FAMILY)


def task(m, n, k, **kw):
    return tg.GemmTask(g.GemmProblem(m, n, k, **kw))


SMALL = {
    "1x1x8": task(1, 1, 8),
    "40x64x64-f16": task(40, 64, 64, dtype="f16"),
    "2x100x64x72-Nmajor-bias-gelu": task(100, 64, 72, b_major="N", batch=2,
                                         epilogue=epi.standard(100, 64, "bf16", batch=2, bias="col",
                                                               activation="gelu")),
    "64x128x64-swiglu": task(64, 128, 64, epilogue=epi.glu(64, 128, "bf16")),
}


@pytest.mark.parametrize("name", SMALL)
def test_every_candidate_renders_a_distinct_kernel_and_the_default_is_one(name):
    t = SMALL[name]
    space = tg.space(t)
    configs = list(space.configs())
    assert space.as_dict(space.default) == asdict(g.default_schedule(t.problem))
    assert space.default in configs
    assert len(configs) == sum(1 for _ in space.admitted())  # pruning leaves nothing the generator rejects
    seen = set()
    for c in configs:
        src = g.render(t.problem, tg.build(t, space.as_dict(c)))
        body = "\n".join(line for line in src.source.splitlines() if not line.startswith("//"))
        assert (body, src.smem_bytes) not in seen, f"{space.as_dict(c)} renders a kernel seen before"
        seen.add((body, src.smem_bytes))


def test_split_k_is_searched_only_where_tiles_leave_sms_idle():
    """Few tiles and a long K (128 x 1024 x 8192): 2 and 4 slices are candidates, each config's
    units within 1.25 waves; a large problem (8192 x 4096 x 4096) keeps split_k at 1 and
    ping-pong off everywhere."""
    few = tg.space(task(128, 1024, 8192))
    configs = [few.as_dict(c) for c in few.configs()]
    splits = {c["split_k"] for c in configs}
    assert splits == {1, 2, 4}
    for c in configs:
        tiles = -(-128 // c["bm"]) * -(-1024 // c["bn"])
        assert c["split_k"] == 1 or (tiles * 2 <= tg.SMS and tiles * c["split_k"] <= tg.SMS * 5 // 4)
        assert not c["pingpong"]
    big = tg.space(task(8192, 4096, 4096))
    assert all(big.as_dict(c)["split_k"] == 1 and not big.as_dict(c)["pingpong"] for c in big.admitted())


ISSUE4 = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 11008, 4096), (512, 4096, 4096), (128, 4096, 4096)]


@pytest.mark.parametrize("shape", ISSUE4, ids=lambda s: "x".join(map(str, s)))
def test_admitted_candidates_respect_the_templates_budgets(shape):
    m, n, k = shape
    t = task(m, n, k)
    space = tg.space(t)
    admitted = list(space.admitted())
    assert space.default in admitted and len(admitted) >= 20
    for c in admitted:
        knobs = space.as_dict(c)
        s = g.GemmSchedule(**knobs)  # raises on BM != 64 x rows x consumers or > 160 accumulators
        assert s.bm == 64 * (s.rows_per_wg // 64) * s.consumers and s.acc_regs <= 160
        assert s.smem_bytes() <= g.SMEM_LIMIT
        if c == space.default:
            continue
        assert s.bm <= max(64, 1 << (m - 1).bit_length())
        deeper = [x for x in tg.STAGES if replace(s, stages=x).smem_bytes() <= g.SMEM_LIMIT and x > s.stages]
        assert len(deeper) < tg.STAGE_DEPTHS  # one of the deepest rings that fit
        assert s.cluster_m == 1 or -(-m // s.bm) >= 2
        rows = -(-m // (s.bm * s.cluster_m))
        covering = [x for x in tg.GROUP_M if x >= rows]
        d_group = space.as_dict(space.default)["group_m"]
        assert s.group_m < rows or s.group_m == (d_group if d_group >= rows else min(covering))  # one of equals
    for c in admitted[:: max(1, len(admitted) // 6)]:  # a spread sample renders (all of them: ~1 min)
        assert space.valid(space.as_dict(c)), space.as_dict(c)


def test_knobs_round_trip_and_unknown_knobs_are_rejected():
    t = task(4096, 4096, 4096)
    sched = g.GemmSchedule(128, 128, stages=6, group_m=4)
    assert tg.build(t, GEMM.knobs(sched)) == sched
    with pytest.raises(ValueError, match="warps"):
        tg.build(t, {**GEMM.knobs(sched), "warps": 8})
    with pytest.raises(ValueError, match="64 or 128 rows"):
        tg.build(t, {**GEMM.knobs(sched), "bm": 192})


def bias_silu(m, n, bias="bias", out="out", name="epilogue"):
    """silu(acc + bias[n]), its buffers and the kernel named as given."""
    e = epi.EpilogueBuilder(m, n)
    x = e.op("add", e.acc(), e.load(bias, "col", "bf16"))
    e.store(out, e.op("mul", x, e.op("sigmoid", x)), "bf16")
    return e.kernel(name)


def test_problems_equal_up_to_names_share_a_cache_key():
    ep = epi.standard(512, 256, "bf16", bias="col", activation="silu")
    renamed = replace(canonicalize(ep, rename_buffers=True), name="somewhere_else")
    assert [b.name for b in renamed.params] != [b.name for b in ep.params]
    assert key_for(task(512, 256, 128, epilogue=bias_silu(512, 256)), H100, GEMM) == key_for(
        task(512, 256, 128, epilogue=bias_silu(512, 256, "b", "y", "other")), H100, GEMM)
    key = key_for(task(512, 256, 128, epilogue=ep), H100, GEMM)
    assert key == key_for(task(512, 256, 128, epilogue=renamed), H100, GEMM)
    assert key_for(task(512, 256, 128), H100, GEMM) == key_for(task(512, 256, 128, epilogue=epi.standard(
        512, 256, "bf16")), H100, GEMM)  # no epilogue is the plain one
    others = [task(512, 256, 128), task(512, 256, 136, epilogue=ep),
              task(512, 256, 128, epilogue=epi.standard(512, 256, "bf16", bias="col", activation="gelu")),
              task(512, 256, 128, b_major="N", epilogue=ep),
              tg.GemmTask(g.GemmProblem(512, 256, 128, "f16", epilogue=epi.standard(512, 256, "f16", bias="col",
                                                                                    activation="silu")))]
    digests = {key.digest} | {key_for(o, H100, GEMM).digest for o in others}
    assert len(digests) == 1 + len(others)
    assert key_for(others[0], tdevice.Device("NVIDIA H200", "9.0", "13.0"), GEMM) != key_for(others[0], H100, GEMM)


def _product(chk: tg.GemmCheck, fn=lambda acc: acc):
    p = chk.task.problem
    a, b = chk.inputs[tg.A], chk.inputs[tg.B]
    bt = b.transpose(-1, -2) if p.b_major == "K" else b
    return fn(a.double() @ bt.double())


def test_the_reference_check_passes_the_right_product_and_fails_wrong_ones():
    chk = tg.gemm_check(task(300, 200, 136), seed=3)
    assert len(chk.rows) == 256 and chk.rows[0] == 0 and chk.rows[-1] == 299
    right = _product(chk).to(torch.bfloat16)
    assert chk.check({"out": right}) is None
    block = right.clone()
    block[256:, 64:128] = (block[256:, 64:128].float() * 1.05).to(torch.bfloat16)
    assert "wrong result: output out" in chk.check({"out": block})
    hole = right.clone()
    hole[-1, 7] = float("nan")
    assert "NaN" in chk.check({"out": hole})
    batched = tg.gemm_check(task(400, 64, 72, b_major="N", batch=2), seed=1)
    assert len(batched.rows) == 256
    assert batched.check({"out": _product(batched).to(torch.bfloat16)}) is None


def test_the_reference_check_runs_epilogues_on_the_sampled_rows():
    m, n, k = 500, 96, 64
    ep = epi.standard(m, n, "bf16", bias="col", activation="gelu", residual=True, row_scale=True)
    chk = tg.gemm_check(task(m, n, k, epilogue=ep), seed=0)
    x = chk.inputs
    want = _product(chk, lambda acc: torch.nn.functional.gelu(acc * x["row_scale"].double()[:, None]
                                                             + x["bias"].double()) + x["residual"].double())
    assert chk.check({"out": want.to(torch.bfloat16)}) is None
    no_residual = want - x["residual"].double()
    assert "wrong result" in chk.check({"out": no_residual.to(torch.bfloat16)})
    glu = tg.gemm_check(task(300, 128, 64, epilogue=epi.glu(300, 128, "bf16")), seed=0)
    acc = _product(glu)
    good = torch.nn.functional.silu(acc[:, 0::2]) * acc[:, 1::2]
    assert glu.check({"out": good.to(torch.bfloat16)}) is None
    swapped = torch.nn.functional.silu(acc[:, 1::2]) * acc[:, 0::2]
    assert "wrong result" in glu.check({"out": swapped.to(torch.bfloat16)})


def test_the_reference_check_reads_tables_at_each_sampled_rows_own_m():
    """An epilogue reading a small table at (m % S, n) (RoPE's cos through views, batch 2):
    the sampled rows are rows of the whole output, so the check must read the table at each
    sampled row's own m, not at its position among the samples; a table read at m instead
    (the first S rows' angles for every batch) is caught."""
    from tilefuse.loop import ir

    m, n, k, S = 600, 64, 64, 300
    e = epi.EpilogueBuilder(m, n)
    t = e.load_at("table", (S, n), "f32", (ir.IBin("%", ir.Var("m"), ir.IConst(S)), ir.Var("n")))
    e.store("out", e.op("mul", e.acc(), t), "bf16")
    chk = tg.gemm_check(task(m, n, k, epilogue=e.kernel()), seed=2)
    assert max(chk.rows) >= S  # some sampled rows are in the second batch
    table = chk.inputs["table"].double()
    acc = _product(chk)
    right = acc * table[torch.arange(m) % S]
    assert chk.check({"out": right.to(torch.bfloat16)}) is None
    rows = torch.as_tensor(chk.rows)
    wrong = right.clone()  # each sampled row with the table row of its position among the samples
    wrong[rows] = acc[rows] * table[torch.arange(len(rows)) % S]
    assert "wrong result" in chk.check({"out": wrong.to(torch.bfloat16)})


class CpuGemmTask(tg.GemmTask):
    family = "gemm-cpu"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    return TuneCache()


def test_the_measure_path_fails_wrong_gemm_candidates_and_picks_among_the_rest(cache, monkeypatch):
    t = CpuGemmTask(g.GemmProblem(300, 200, 136))
    full = tg.space(t)
    few = full.restrict(bn=(64, 96, 128), stages=(5, 6, 7, 8), group_m=(4, 8), cluster_m=1, tma_store=True)
    fam = get_family("gemm-cpu")
    monkeypatch.setitem(_FAMILIES, "gemm-cpu", replace(fam, space=lambda kernel, arch: few))
    opts = TuneOptions(exhaustive=True, device="cpu", rep_ms=2.0, confirm_rep_ms=4.0, confirm=2)
    r = Tuner(InlinePool(), H100, cache, opts, measure_fn=measure).tune({"gemm": t})[0]
    assert r.status == "tuned" and r.evaluated == len(list(few.configs())) >= 6
    assert r.knobs["bn"] != 96 and r.knobs["stages"] != 5
    for f in r.failures:
        kn = f["knobs"]
        if kn["stages"] == 5:
            assert "differs between two launches" in f["reason"], f
        else:
            assert kn["bn"] == 96 and "wrong result" in f["reason"] and "torch.matmul" in f["reason"], f
    assert {(f["knobs"]["bn"], f["knobs"]["stages"]) for f in r.failures} >= {(96, 6), (64, 5)}
    assert cache.get(key_for(t, H100, get_family("gemm-cpu"))).knobs == r.knobs


def test_compile_ahead_ships_kernels_compiled_elsewhere_and_fails_what_does_not_compile(cache):
    k = replace(fx.rmsnorm_kernel(100, 8, "bf16"), family="interp-cpu-ahead")
    tune_fakes.MADE_IN.clear()
    opts = TuneOptions(exhaustive=True, device="cpu", rep_ms=2.0, confirm_rep_ms=4.0, jobs=2)
    with Tuner(InlinePool(), H100, cache, opts, measure_fn=measure) as tuner:
        r = tuner.tune({"k": k})[0]
    assert r.status == "tuned" and r.knobs["threads"] != 64
    compile_failures = [f for f in r.failures if f["knobs"]["threads"] == 64]
    # the reason, then where it was raised (a compile process's failure has no traceback here)
    assert compile_failures and all(f["reason"].startswith("compile failed: RuntimeError: NVRTC: too many resources "
                                                           "requested for launch (raised at ")
                                    and "tune_fakes.py" in f["reason"] for f in compile_failures)
    # the search's launches come first (the confirmation compiles its finalists here again)
    here = tune_fakes.MADE_IN.index(os.getpid()) if os.getpid() in tune_fakes.MADE_IN else len(tune_fakes.MADE_IN)
    measured = r.evaluated - r.failed
    assert measured > 0 and here >= 3 * measured  # two checked launches and a timed one at least, each
    assert len(set(tune_fakes.MADE_IN[:here])) >= 1  # ...of kernels compiled in the compile-ahead processes


def test_tuned_gemm_schedule_reads_the_cache_on_the_gpu_it_was_tuned_on(cache, monkeypatch):
    problem = g.GemmProblem(2048, 1024, 512, epilogue=bias_silu(2048, 1024))
    assert lookup.tuned_gemm_schedule(problem, "sm_90a") is None  # no GPU here
    monkeypatch.setattr(tdevice, "cuda_device", lambda index=0: H100)
    assert lookup.tuned_gemm_schedule(problem, "sm_90a", torch.device("cuda", 0)) is None  # not tuned
    miss = lookup.choose_gemm(problem, "sm_90a")
    assert not miss.tuned and miss.schedule == g.default_schedule(problem) and "not tuned" in miss.note
    pick = g.GemmSchedule(128, 128, stages=6, group_m=4)
    cache.put(Entry(key_for(tg.GemmTask(problem), H100, GEMM), GEMM.knobs(pick), {"median_us": 90.0,
                                                                                    "default_us": 99.0}))
    assert lookup.tuned_gemm_schedule(problem, "sm_90a", torch.device("cuda", 0)) == pick
    assert lookup.tuned_gemm_schedule(problem, None, 0) == pick
    renamed = replace(problem, epilogue=bias_silu(2048, 1024, "b", "y", "elsewhere"))
    assert lookup.tuned_gemm_schedule(renamed) == pick
    assert "cache hit" in lookup.choose_gemm(problem).note
    assert lookup.tuned_gemm_schedule(replace(problem, k=1024)) is None
    assert lookup.tuned_gemm_schedule(problem, "sm_80") is None
    monkeypatch.setenv("TILEFUSE_TUNED", "0")
    assert lookup.tuned_gemm_schedule(problem) is None
