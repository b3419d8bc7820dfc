"""The tuner on a real GPU: a small map-reduce program tuned end to end.

- The pick is correct (the compiled program, which takes the tuned knobs by itself, passes
  the 2x rule against float64 PyTorch) and not slower than the heuristic default beyond
  noise (both re-timed here, side by side, several rounds).
- A second run hits the cache for every kernel in under a second, and starts no worker.
- A candidate that makes an illegal memory access kills its worker process, not the tuner:
  the next job runs in a fresh process.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import tilefuse
from tilefuse import dtypes
from tilefuse.check import compare, flatten, float64_reference
from tilefuse.codegen.mapreduce import default_schedule
from tilefuse.compiler import compile_stages
from tilefuse.runtime.launch import compile_kernel
from tilefuse.tune.cache import TuneCache
from tilefuse.tune.device import cuda_device
from tilefuse.tune.families import get_family
from tilefuse.tune.tuner import TuneOptions, Tuner
from tilefuse.tune.worker import WorkerPool

pytestmark = pytest.mark.gpu

ROWS, COLS = 8192, 4096


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
def program():
    torch.manual_seed(0)
    module = AddRMSNorm(COLS).cuda().bfloat16()
    inputs = tuple(torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return module, inputs, compile_stages(module, inputs)


@pytest.fixture(scope="module")
def tuned(cache_dir, program):
    _, _, st = program
    kernels = {n: lk.kernel for n, lk in st.kernels.items()}
    t0 = time.perf_counter()
    with WorkerPool([0], timeout=60) as pool:
        results = Tuner(pool, cuda_device(0), TuneCache(), TuneOptions(budget=16, threshold=0)).tune(kernels)
    return results, time.perf_counter() - t0


def _median_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def test_the_pick_is_correct_and_not_slower_than_the_default(program, tuned):
    module, inputs, st = program
    results, wall = tuned
    print(f"\ntuning wall time {wall:.1f} s: " + "; ".join(
        f"{r.name}: {r.status} {r.best_us:.1f} us vs default {r.default_us:.1f} us, {r.evaluated} tried, "
        f"{r.failed} failed, knobs {r.knobs}" for r in results))
    assert all(r.status == "tuned" for r in results), [(r.name, r.note) for r in results]
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
        tensors = []
        for b in k.params:
            tensors.append(torch.randn(b.shape, device="cuda").to(dtypes.to_torch(b.dtype)))
        rounds = [(_median_us(lambda: fast(*tensors)), _median_us(lambda: base(*tensors))) for _ in range(3)]
        t_fast, t_base = min(x[0] for x in rounds), min(x[1] for x in rounds)
        print(f"{name}: tuned {t_fast:.1f} us, default {t_base:.1f} us ({t_base / t_fast:.2f}x)")
        assert t_fast <= 1.05 * t_base


def test_a_second_run_hits_the_cache_for_every_kernel_in_under_a_second(program, tuned):
    _, _, st = program
    kernels = {n: lk.kernel for n, lk in st.kernels.items()}
    pool = WorkerPool([0])
    t0 = time.perf_counter()
    results = Tuner(pool, cuda_device(0), TuneCache(), TuneOptions(budget=16)).tune(kernels)
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


def test_an_illegal_address_kills_the_worker_not_the_tuner():
    with WorkerPool([0], timeout=120) as pool:
        first = pool.submit(pid, None).result()
        out = pool.submit(illegal_access, None).result()
        print(f"\nillegal access: {out.reason}")
        assert not out.ok and ("illegal" in out.reason or "died" in out.reason), out.reason
        again = pool.submit(pid, None).result()
        assert again.ok and again.value != first.value
