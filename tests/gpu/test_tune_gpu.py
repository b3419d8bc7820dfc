"""The tuner on a real GPU: a map-reduce program and a GEMM tuned end to end.

- The map-reduce pick is correct (the compiled program, which takes the tuned knobs by
  itself, passes the 2x rule against float64 PyTorch) and not slower than the heuristic
  default beyond noise (both re-timed here, side by side, several rounds).
- The GEMM pick (a GEMM with tails in M and N and a bias + GELU epilogue) is what
  `tuned_gemm_schedule` returns, passes the 2x rule on every element against a float32
  torch reference on fresh inputs, and is not slower than the default beyond noise.
- A second run hits the cache for every kernel in under a second, and starts no worker.
- A candidate that makes an illegal memory access kills its worker process, not the tuner:
  the next job runs in a fresh process.
- The fused cross-entropy mean (a kernel with a grid-reduction workspace, opt-in) is tuned:
  no candidate fails its check, and the compiled program, which takes the pick by itself,
  passes the 2x rule against float64 PyTorch.
One worker process serves the tests (its start-up, CUDA and torch, is paid once).
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import tilefuse
from tilefuse import dtypes
from tilefuse.check import compare, flatten, float64_reference, rel_error
from tilefuse.codegen import epilogue as epi
from tilefuse.codegen.gemm_sm90 import GemmProblem, GemmSchedule, default_schedule as gemm_default
from tilefuse.codegen.mapreduce import default_schedule
from tilefuse.compiler import compile_stages
from tilefuse.runtime.gemm import compile_gemm
from tilefuse.runtime.launch import compile_kernel
from tilefuse.tune.cache import TuneCache
from tilefuse.tune.device import cuda_device
from tilefuse.tune.families import get_family
from tilefuse.tune.gemm import GemmTask
from tilefuse.tune.lookup import tuned_gemm_schedule
from tilefuse.tune.tuner import TuneOptions, Tuner
from tilefuse.tune.worker import WorkerPool

pytestmark = pytest.mark.gpu

ROWS, COLS = 8192, 4096
GEMM_M, GEMM_N, GEMM_K = 1000, 1544, 1024  # tails in M and N
JOBS = max(1, min(8, (os.cpu_count() or 2) - 1))


class AddRMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n))

    def forward(self, x, res):
        h = x + res
        return h, torch.nn.functional.rms_norm(h, (h.shape[-1],), self.weight, 1e-6)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tunecache")
    old = os.environ.get("TILEFUSE_CACHE_DIR")
    os.environ["TILEFUSE_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("TILEFUSE_CACHE_DIR")
    else:
        os.environ["TILEFUSE_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def pool(cache_dir):
    with WorkerPool([0], timeout=60) as p:
        yield p


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    module = AddRMSNorm(COLS).cuda().bfloat16()
    inputs = tuple(torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return module, inputs, compile_stages(module, inputs)


@pytest.fixture(scope="module")
def tuned(pool, program):
    _, _, st = program
    kernels = {n: lk.kernel for n, lk in st.kernels.items()}
    t0 = time.perf_counter()
    with Tuner(pool, cuda_device(0), TuneCache(), TuneOptions(budget=12, threshold=0, jobs=JOBS)) as tuner:
        results = tuner.tune(kernels)
    return results, time.perf_counter() - t0


def _median_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def _not_slower(fast, base, what: str):
    rounds = [(_median_us(fast), _median_us(base)) for _ in range(3)]
    t_fast, t_base = min(x[0] for x in rounds), min(x[1] for x in rounds)
    print(f"{what}: tuned {t_fast:.1f} us, default {t_base:.1f} us ({t_base / t_fast:.2f}x)")
    assert t_fast <= 1.05 * t_base


def test_the_pick_is_correct_and_not_slower_than_the_default(program, tuned):
    module, inputs, st = program
    results, wall = tuned
    print(f"\ntuning wall time {wall:.1f} s: " + "; ".join(
        f"{r.name}: {r.status} {r.best_us} us vs default {r.default_us} us, {r.evaluated} tried, "
        f"{r.failed} failed, knobs {r.knobs}" for r in results))
    assert all(r.status == "tuned" for r in results), [(r.name, r.note, r.failures[:2]) for r in results]
    prog = tilefuse.compile(module, inputs)  # takes the tuned knobs from the cache by itself
    for name, lk in st.kernels.items():
        ck = prog.compiled(lk, inputs[0].device)
        r = next(x for x in results if x.name == name)
        assert get_family("mapreduce").knobs(ck.schedule) == r.knobs
    outs = flatten(prog(*inputs))
    ref = flatten(float64_reference(module, inputs))
    with torch.no_grad():
        eager = flatten(module(*inputs))
    for i, (o, r64, e) in enumerate(zip(outs, ref, eager)):
        c = compare(f"out{i}", o, r64, e)
        assert c.ok, c
    for name, lk in st.kernels.items():
        k = lk.kernel
        r = next(x for x in results if x.name == name)
        fast = compile_kernel(k, schedule=get_family("mapreduce").build(k, r.knobs, "sm_90a"))
        base = compile_kernel(k, schedule=default_schedule(k))
        tensors = [torch.randn(b.shape, device="cuda").to(dtypes.to_torch(b.dtype)) for b in k.params]
        _not_slower(lambda: fast(*tensors), lambda: base(*tensors), name)


def gemm_problem() -> GemmProblem:
    ep = epi.standard(GEMM_M, GEMM_N, "bf16", bias="col", activation="gelu")
    return GemmProblem(GEMM_M, GEMM_N, GEMM_K, "bf16", epilogue=ep)


@pytest.fixture(scope="module")
def tuned_gemm(pool):
    task = GemmTask(gemm_problem(), name="gemm_bias_gelu")
    t0 = time.perf_counter()
    with Tuner(pool, cuda_device(0), TuneCache(), TuneOptions(budget=12, jobs=JOBS)) as tuner:
        (r,) = tuner.tune({task.name: task})
    return r, time.perf_counter() - t0


def test_the_gemm_pick_is_found_by_the_planners_lookup_and_is_right_everywhere(tuned_gemm):
    r, wall = tuned_gemm
    print(f"\nGEMM tuning {wall:.1f} s: {r.status} {r.best_us} us vs default {r.default_us} us, {r.evaluated} "
          f"tried, {r.failed} failed ({[f['reason'] for f in r.failures][:3]}), knobs {r.knobs}")
    assert r.status == "tuned" and r.method == "sp-mcts", r.note
    problem = gemm_problem()
    sched = tuned_gemm_schedule(problem, "sm_90a", torch.device("cuda", 0))
    assert sched == GemmSchedule(**r.knobs)
    g = compile_gemm(problem, sched)
    x = torch.randn(GEMM_M, GEMM_K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(GEMM_N, GEMM_K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(GEMM_N, device="cuda", dtype=torch.bfloat16)
    out = torch.full((GEMM_M, GEMM_N), float("nan"), device="cuda", dtype=torch.bfloat16)
    g(x, w, out=out, bias=bias)
    torch.cuda.synchronize()
    ref = torch.nn.functional.gelu(x.float() @ w.float().T + bias.float())
    lowp = torch.nn.functional.gelu(x @ w.T + bias)
    assert torch.isfinite(out).all()
    err, base = rel_error(out.float(), ref), rel_error(lowp.float(), ref)
    assert err <= 2 * base + 1e-5, (err, base)
    d = compile_gemm(problem, gemm_default(problem))
    _not_slower(lambda: g(x, w, out=out, bias=bias), lambda: d(x, w, out=out, bias=bias), "gemm")


def test_a_second_run_hits_the_cache_for_every_kernel_in_under_a_second(program, tuned, tuned_gemm):
    _, _, st = program
    kernels = {n: lk.kernel for n, lk in st.kernels.items()}
    kernels["gemm"] = GemmTask(gemm_problem())
    pool = WorkerPool([0])
    t0 = time.perf_counter()
    results = Tuner(pool, cuda_device(0), TuneCache(), TuneOptions(budget=16, jobs=JOBS)).tune(kernels)
    dt = time.perf_counter() - t0
    pool.close()
    print(f"\nsecond run: {dt * 1e3:.0f} ms for {len(kernels)} kernel(s)")
    assert [r.status for r in results] == ["cached"] * len(kernels)
    assert all(w.pid is None for w in pool.workers)  # no worker was started
    assert dt < 1.0 * len(kernels)


def illegal_access(_):
    """Launch a real kernel on an input pointer nobody owns (runs in the worker)."""
    from tilefuse.loop.ir import Buffer, Kernel, Load, Loop, Store, Var

    k = Kernel("poke", (Buffer("x", (1024, 1024), "f32", "in"), Buffer("y", (1024, 1024), "f32", "out")),
               (Loop("r", 1024, (Loop("c", 1024, (Load("v", "x", (Var("r"), Var("c"))),
                                                   Store("y", (Var("r"), Var("c")), "v"))),), parallel=True),))
    ck = compile_kernel(k)
    y = torch.empty(1024, 1024, device="cuda")
    ck.launch_ptrs(0, [0x100000, y.data_ptr()])
    torch.cuda.synchronize()
    return "no error?"


def pid(_):
    return os.getpid()


def test_an_illegal_address_kills_the_worker_not_the_tuner(pool):
    first = pool.submit(pid, None).result()
    out = pool.submit(illegal_access, None).result()
    print(f"\nillegal access: {out.reason}")
    assert not out.ok and ("illegal" in out.reason or "died" in out.reason), out.reason
    again = pool.submit(pid, None).result()
    assert again.ok and again.value != first.value


CE_ROWS, CE_COLS = 1000, 4096  # four row groups of the grid reduction, the last one partial


def test_a_grid_reduced_cross_entropy_mean_is_tuned_and_its_pick_is_right(pool, monkeypatch):
    """The fused cross-entropy mean (one kernel; the last CTA reduces the per-row losses through
    its workspace) goes through the tuner: status tuned, each candidate launched on its own
    zeroed workspace, checked (two launches on that workspace must agree bit for bit, then the
    2x rule) and timed like any kernel, and none fails its check. The compiled program takes the
    pick from the cache by itself, and its loss passes the 2x rule against float64 PyTorch on
    16 fresh draws pooled (ignored rows included: the mean divides by the others)."""
    import torch.nn.functional as F

    monkeypatch.setenv("TILEFUSE_GRID_REDUCE", "1")  # opt-in (graph/fusion.py)
    fn = lambda x, t: F.cross_entropy(x, t)  # noqa: E731

    def make():
        x = torch.randn(CE_ROWS, CE_COLS, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, CE_COLS, (CE_ROWS,), device="cuda")
        t[torch.rand(CE_ROWS, device="cuda") < 0.1] = -100
        return x, t

    st = compile_stages(fn, make())
    (step,) = [s for s in st.plan.steps if s.family == "mapreduce"]
    kernel = st.kernels[step.name].kernel
    assert step.tail is not None and kernel.scratch, st.plan
    t0 = time.perf_counter()
    opts = TuneOptions(budget=8, threshold=0, polish=0, confirm=2, confirm_rounds=2, jobs=JOBS)
    with Tuner(pool, cuda_device(0), TuneCache(), opts) as tuner:
        (r,) = tuner.tune({step.name: kernel})
    reasons = [f["reason"] for f in r.failures]
    print(f"\nCE mean {CE_ROWS}x{CE_COLS}: {r.status} in {time.perf_counter() - t0:.1f} s, {r.best_us} us vs "
          f"default {r.default_us} us, {r.evaluated} tried, {r.failed} failed {reasons[:3]}, knobs {r.knobs}")
    assert r.status == "tuned", (r.note, reasons)
    assert not [x for x in reasons if "wrong result" in x or "differs" in x], reasons

    prog = tilefuse.compile(fn, make())
    (pstep,) = [s for s in prog.plan.steps if s.family == "mapreduce"]
    got, refs, eager = [], [], []
    for _ in range(16):
        inputs = make()
        got.append(prog(*inputs).clone().reshape(1))
        refs.append(float64_reference(fn, inputs).reshape(1))
        with torch.no_grad():
            eager.append(fn(*inputs).reshape(1))
    ck = prog.compiled(prog.kernels[pstep.name], inputs[0].device)
    assert get_family("mapreduce").knobs(ck.schedule) == r.knobs, "the program did not take the tuned knobs"
    c = compare("loss", torch.cat(got), torch.cat(refs), torch.cat(eager))
    assert c.ok, c
