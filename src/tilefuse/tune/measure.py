"""What a benchmark worker does with one candidate: build, compile, check, time.

Runs inside a worker process (worker.py) on the GPU that process was given. Per kernel it
keeps one `_State` (inputs on the GPU, the references) while candidates of that kernel
arrive, so only the first candidate pays for inputs and references.

A candidate fails (raises; the worker reports the reason) when its knobs do not build a
schedule, NVRTC rejects it, it leaves an output element unwritten or differs between two
launches (outputs are poisoned with two different values before two launches, which must
agree bit for bit), or it breaks the 2x rule on the checked rows (reference.py). A CUDA
error raises `Fatal`: the context is unusable, the worker exits and is replaced.

Timing, as DESIGN.md says and as the benchmarks time (analyze.bench.timings_ms: CUDA events,
warm-up, L2 flushed by a read before each repetition), the median and spread of the
repetitions. When all the kernel's buffers fit in L2 several copies of them are rotated as
well, so no launch finds its data in L2; the time is then each copy's median averaged over
the copies, the fastest and slowest tenth left out (`placement_median`: where the buffers
land moved a 6 us kernel's time by 12%).

A kernel with a grid reduction (the fused cross-entropy mean) takes a workspace after its
parameters. Each candidate gets its own, made by the runtime's `launch.new_workspace` (zeroed
once), and every launch of that candidate, checks and timed repetitions alike, uses it without
a reset in between: a compiled program's runner keeps one workspace per kernel the same way
and never clears it (the kernel leaves its counters at zero), so the time is what a user's
call costs. Both check launches run on the same workspace, so a candidate that leaves it
dirty (a counter not reset) fails there, before it is timed.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from .worker import Fatal

ROTATE_MAX = 64  # buffer copies at most (small kernels)


class NoReference(RuntimeError):
    """The kernel's inputs or references could not be built: no candidate can be checked."""


@dataclass(frozen=True)
class MeasureJob:
    family: str
    kernel: object        # the family's kernel object (a Loop IR Kernel for map-reduce)
    knobs: dict
    arch: str
    seed: int = 0
    warmup_ms: float = 10.0
    rep_ms: float = 40.0
    check: bool = True
    device: str = "cuda"  # "cpu": the whole path but the timing method (tests, no GPU)
    compiled: object = None  # the candidate compiled ahead in another process (precompile.py), or None


@dataclass(frozen=True)
class Measurement:
    median_us: float
    stats: dict = field(default_factory=dict)   # min_us, p20_us, p80_us, reps, copies
    registers: int = -1
    spill_bytes: int = 0
    compile_s: float = 0.0
    cubin_cached: bool = False


_STATE: dict = {}  # (family, kernel hash, signature, seed) -> _State; one kernel at a time


@dataclass
class _State:
    problem: object
    inputs: dict    # name -> tensor on the job's device
    outputs: dict   # name -> (shape, torch dtype)
    device: str


def _state(job: MeasureJob, fam) -> _State:
    import torch

    from .. import dtypes
    from ..tensors import to_torch

    key = (job.family, *fam.describe(job.kernel), job.seed, job.device)
    if key not in _STATE:
        _STATE.clear()
        try:
            problem = fam.problem(job.kernel, job.seed, job.device)
        except Exception as e:
            raise NoReference(f"no reference to check against: {type(e).__name__}: {e}") from None
        inputs = {n: (a if isinstance(a, torch.Tensor) else to_torch(a)).to(job.device)
                  for n, a in problem.inputs.items()}
        outputs = {n: (tuple(shape), dtypes.to_torch(dt)) for n, (shape, dt) in problem.outputs.items()}
        if job.device == "cuda":
            torch.cuda.synchronize()
        _STATE[key] = _State(problem, inputs, outputs, job.device)
    return _STATE[key]


def _poisoned(spec, which: int, device: str):
    import torch

    shape, dt = spec
    if dt.is_floating_point:
        fill = (float("nan"), 7.25)[which]
    elif dt == torch.bool:
        fill = bool(which)
    else:
        fill = (-12345, 12345)[which] if dt.is_signed else (7, 201)[which]
    return torch.full(shape, fill, dtype=dt, device=device)


def _same(a, b) -> bool:
    import torch

    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _sync(what: str, device: str = "cuda"):
    import torch

    if device != "cuda":
        return
    try:
        torch.cuda.synchronize()
    except Exception as e:  # a launch error surfaces here: the context is gone
        raise Fatal(f"{what}: {str(e).strip().splitlines()[0]}") from e


def measure(job: MeasureJob) -> Measurement:
    """Compile, check and time one candidate; raise with a one-line reason if it fails."""
    from .families import get_family

    fam = get_family(job.family)
    try:
        schedule = fam.build(job.kernel, job.knobs, job.arch)
    except ValueError as e:
        raise ValueError(f"invalid knobs: {e}") from None
    t0 = time.perf_counter()
    fn = job.compiled if job.compiled is not None else fam.compile(job.kernel, schedule, job.arch)
    compile_s = time.perf_counter() - t0
    st = _state(job, fam)
    fn = _with_workspace(fn, st.device)
    runs = []
    for which in (0, 1):
        tensors = dict(st.inputs)
        outs = {n: _poisoned(spec, which, st.device) for n, spec in st.outputs.items()}
        tensors.update(outs)
        try:
            st.problem.call(fn, tensors)
        except Exception as e:
            if "CUDA" in str(e) or "launch" in str(e):
                raise Fatal(f"launch failed: {str(e).strip().splitlines()[0]}") from e
            raise
        _sync("the kernel failed", st.device)
        runs.append(outs)
    for n in st.outputs:
        if not _same(runs[0][n], runs[1][n]):
            raise ValueError(f"output {n} differs between two launches (an element left unwritten, or a race)")
    if job.check:
        why = st.problem.check(runs[0])
        if why:
            raise ValueError(why)
    med, stats = _time(fn, st, job) if st.device == "cuda" else _time_host(fn, st, job)
    info = getattr(fn, "info", None)
    return Measurement(med, stats, registers=getattr(info, "registers", -1),
                       spill_bytes=getattr(info, "spill_stores", 0) + getattr(info, "spill_loads", 0),
                       compile_s=compile_s, cubin_cached=bool(getattr(fn, "cache_hit", False)))


def _with_workspace(fn, device: str):
    """`fn`, launched with a fresh workspace of its own when it takes one (a grid reduction):
    the runtime's allocation, kept for all of this candidate's launches (see the module's doc)."""
    import functools

    from ..runtime.launch import new_workspace, workspace_bytes

    nbytes = workspace_bytes(fn)
    if not nbytes:
        return fn
    ws = new_workspace(nbytes, device)
    bound = functools.partial(fn, workspace=ws)
    for attr in ("info", "cache_hit"):  # what the Measurement reports about the compiled kernel
        if hasattr(fn, attr):
            setattr(bound, attr, getattr(fn, attr))
    return bound


def _time(fn, st: _State, job: MeasureJob):
    import torch

    from ..analyze.bench import timings_ms

    nbytes = sum(t.numel() * t.element_size() for t in st.inputs.values())
    nbytes += sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in st.outputs.values())
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    copies = 1 if nbytes >= l2 else min(ROTATE_MAX, math.ceil(3 * l2 / max(nbytes, 1)))
    sets = []
    for i in range(copies):
        t = {n: (x if i == 0 else x.clone()) for n, x in st.inputs.items()}
        t.update({n: torch.empty(s, dtype=d, device="cuda") for n, (s, d) in st.outputs.items()})
        sets.append(t)
    used = []  # the copy each call ran on, in order

    def run():
        used.append(len(used) % copies)
        st.problem.call(fn, sets[used[-1]])

    times = timings_ms(run, warmup=job.warmup_ms, rep=job.rep_ms)
    _sync("the kernel failed while being timed")
    us = [t * 1e3 for t in times]
    med = placement_median(us, used[-len(us):])
    s = sorted(us)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return med, {"median_us": med, "pooled_median_us": statistics.median(s), "min_us": s[0], "p20_us": q(0.2),
                 "p80_us": q(0.8), "reps": len(s), "copies": copies}


def placement_median(times: list[float], copy_of: list[int]) -> float:
    """The mean over buffer copies of each copy's median time, the fastest and slowest tenth
    of the copies left out (a copy seen once is one repetition, maybe a hiccup); with fewer
    than 10 copies seen, the median of their medians (the plain median for one copy).

    Where a buffer lands decides a few-microsecond kernel's time: on an H100 the one-row sum
    finishing a cross-entropy mean took 7.5 us on every even copy and 6.7 us on every odd
    one, pass after pass (bench/measure_spread.py). The median of the pooled repetitions of
    such a two-mode mixture sits in one mode or the other by a hair, so one candidate timed
    twice read 6.6 then 7.3 us, more than schedules differ by. Each copy's median is stable,
    and so is their mean: the time averaged over placements, as a user's buffers fall."""
    by: dict[int, list[float]] = {}
    for t, c in zip(times, copy_of):
        by.setdefault(c, []).append(t)
    meds = sorted(statistics.median(v) for v in by.values())
    if len(meds) < 10:
        return statistics.median(meds)
    cut = len(meds) // 10
    return statistics.fmean(meds[cut:len(meds) - cut])


def _time_host(fn, st: _State, job: MeasureJob):
    """Wall-clock median of repeated calls: the timing for a non-CUDA device (tests)."""
    t = dict(st.inputs)
    t.update({n: torch_empty(s, d, st.device) for n, (s, d) in st.outputs.items()})
    times, end = [], time.perf_counter() + job.rep_ms / 1e3
    while not times or (time.perf_counter() < end and len(times) < 1000):
        t0 = time.perf_counter()
        st.problem.call(fn, t)
        times.append((time.perf_counter() - t0) * 1e6)
    med = statistics.median(times)
    return med, {"median_us": med, "min_us": min(times), "reps": len(times), "copies": 1}


def torch_empty(shape, dtype, device):
    import torch

    return torch.empty(shape, dtype=dtype, device=device)
