"""Tuning kernels: a search per kernel, candidates measured by the workers, picks cached.

    tuner = Tuner(pool, device, cache, TuneOptions(budget=64))
    results = tuner.tune({"k0": kernel0, "k1": kernel1})

For each distinct kernel (kernels with one cache key are tuned once): a cache hit ends it
(unless `force`); otherwise the family's space is searched (exhaustive at or under
`threshold` admitted configs or the space's `exhaustive_upto` valid ones, SP-MCTS
otherwise; the heuristic default is always measured first), up to `pool.size` candidates at once. With `jobs` > 0, candidates are compiled
ahead in that many CPU processes (precompile.py) while the workers measure others: an
exhaustive search as far ahead as there are processes, SP-MCTS only `lookahead` beyond one
per worker, so that its proposals still learn from the latest results. A candidate that
does not compile fails there, with the compiler's reason. Then the best few and the default are timed
again, longer, side by side, and the fastest is stored with its statistics and the
failures met on the way. `on_event(kind, **info)` reports progress ("start", "trial",
"done") for a progress bar.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from typing import Callable

from .cache import Entry, Key, TuneCache, key_for
from .families import get_family
from .measure import MeasureJob, measure
from .precompile import compiler_pool, prepare
from .search import Exhaustive, make_searcher


@dataclass(frozen=True)
class TuneOptions:
    budget: int = 64             # candidates measured per kernel (SP-MCTS)
    exhaustive: bool = False     # measure every valid candidate
    threshold: int = 48          # spaces this small are measured exhaustively anyway
    patience: int | None = 32    # stop after this many results without a 0.5% gain
    polish: int = 24             # SP-MCTS, then up to this many one-knob neighbours of the best (search.py)
    seed: int = 0
    timeout: float = 60.0        # watchdog per candidate, seconds
    warmup_ms: float = 10.0
    rep_ms: float = 40.0
    confirm: int = 3             # best candidates re-timed against the default at the end
    confirm_rep_ms: float = 120.0
    confirm_rounds: int = 3      # the finalists are timed in turn this many times (min of medians)
    min_gain: float = 0.01       # a pick must beat the default by this fraction, else the default stays
    force: bool = False          # re-tune kernels the cache already has
    give_up: int = 8             # stop a kernel whose first this-many candidates all failed
    jobs: int = 0                # CPU processes compiling candidates ahead of the workers (0: workers compile)
    lookahead: int = 2           # SP-MCTS: candidates compiled ahead beyond one per worker
    device: str = "cuda"         # where candidates run ("cpu" only for tests of the whole path)


@dataclass
class KernelResult:
    name: str
    key: Key
    status: str                  # "tuned", "cached", "same-as" (another kernel's key), "failed"
    knobs: dict | None = None
    default_knobs: dict | None = None
    best_us: float | None = None
    default_us: float | None = None
    evaluated: int = 0
    failed: int = 0
    failures: list = field(default_factory=list)   # [{"knobs": ..., "reason": ...}]
    method: str = ""
    wall_s: float = 0.0
    note: str = ""

    @property
    def speedup(self) -> float | None:
        if self.best_us and self.default_us:
            return self.default_us / self.best_us
        return None


class Tuner:
    def __init__(self, pool, device, cache: TuneCache | None = None, options: TuneOptions = TuneOptions(),
                 on_event: Callable | None = None, measure_fn: Callable = measure, arch: str | None = None,
                 compiler=None):
        self.pool = pool
        self.device = device
        self.cache = cache or TuneCache()
        self.options = options
        self.on_event = on_event or (lambda kind, **info: None)
        self.measure_fn = measure_fn
        self.arch = arch or device.arch
        self._pool = compiler  # compile-ahead processes (TuneOptions.jobs); one passed in is the caller's to close
        self._own_pool = compiler is None

    def tune(self, kernels: dict) -> list[KernelResult]:
        """Tune each kernel (name -> kernel); kernels sharing a cache key are measured once."""
        results, first = [], {}
        for name, kernel in kernels.items():
            key = key_for(kernel, self.device, get_family(kernel.family))
            if key.digest in first:
                prev = first[key.digest]
                r = KernelResult(name, key, "same-as", prev.knobs, prev.default_knobs, prev.best_us, prev.default_us,
                                 note=f"same kernel as {prev.name} (one cache entry)")
                self.on_event("done", name=name, result=r)
            else:
                r = self.tune_kernel(name, kernel, key)
                first[key.digest] = r
            results.append(r)
        return results

    # ---------------------------------------------------------------- one kernel
    def _job(self, kernel, knobs: dict, rep_ms: float, compiled=None) -> MeasureJob:
        o = self.options
        return MeasureJob(kernel.family, kernel, knobs, self.arch, o.seed, o.warmup_ms, rep_ms, device=o.device,
                          compiled=compiled)

    def _compiler(self):
        """The compile-ahead process pool (created on first use, kept until `close`), or None."""
        if self.options.jobs <= 0:
            return None
        if self._pool is None:
            self._pool = compiler_pool(self.options.jobs)
        return self._pool

    def close(self):
        if self._pool is not None and self._own_pool:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def tune_kernel(self, name: str, kernel, key: Key | None = None, space=None) -> KernelResult:
        """Tune one kernel; `space` replaces the family's (e.g. a `Space.restrict`ed one, to
        measure the exhaustive best of a neighbourhood)."""
        o = self.options
        fam = get_family(kernel.family)
        key = key or key_for(kernel, self.device, fam)
        t0 = time.perf_counter()
        if not o.force:
            hit = self.cache.get(key)
            if hit is not None:
                r = KernelResult(name, key, "cached", hit.knobs, hit.stats.get("default_knobs"),
                                 hit.stats.get("median_us"), hit.stats.get("default_us"),
                                 evaluated=hit.stats.get("evaluated", 0), method=hit.stats.get("method", ""),
                                 wall_s=time.perf_counter() - t0, note="cache hit")
                self.on_event("done", name=name, result=r)
                return r
        space = space or fam.space(kernel, self.arch)
        default = space.as_dict(space.default) if space.default is not None else None
        searcher = make_searcher(space, o.budget, exhaustive=o.exhaustive, threshold=o.threshold, seed=o.seed,
                                 patience=o.patience, polish=o.polish)
        method = "exhaustive" if isinstance(searcher, Exhaustive) else "sp-mcts"
        total = len(searcher.configs) if method == "exhaustive" else o.budget + o.polish
        self.on_event("start", name=name, total=total, method=method)
        measured: dict = {}   # config -> Measurement
        failures: list = []
        pending: dict = {}    # measurement future -> config
        compiling: dict = {}  # compile-ahead future -> config
        ready: deque = deque()  # (config, compiled kernel or None), waiting for a worker
        abort = ""
        compiler = self._compiler()
        # candidates compiled ahead: enough to keep the workers busy; an exhaustive search
        # may run further ahead (its order does not learn from results), SP-MCTS not much
        ahead = 0 if compiler is None else (o.jobs if method == "exhaustive" else min(o.jobs, o.lookahead + self.pool.size))

        def report(config, ok, reason="", us=None):
            self.on_event("trial", name=name, done=len(searcher.history), total=total, ok=ok,
                          knobs=space.as_dict(config), us=us, reason=reason, best_us=searcher.best_cost,
                          default_us=measured[space.default].median_us if space.default in measured else None)

        def failed(config, reason):
            nonlocal abort
            failures.append({"knobs": space.as_dict(config), "reason": reason})
            searcher.tell(config, None)
            if reason.startswith("NoReference"):
                abort = reason
            elif not measured and len(failures) >= o.give_up:
                abort = f"the first {len(failures)} candidates failed, the first with: {failures[0]['reason']}"
            report(config, False, reason)

        while True:
            while not abort:
                if compiler is None and len(pending) >= self.pool.size:
                    break
                if compiler is not None and len(compiling) + len(ready) + len(pending) >= ahead:
                    break
                config = searcher.ask()
                if config is None:
                    break
                if compiler is None:
                    job = self._job(kernel, space.as_dict(config), o.rep_ms)
                    pending[self.pool.submit(self.measure_fn, job, o.timeout)] = config
                else:
                    work = (fam, kernel, space.as_dict(config), self.arch)
                    compiling[compiler.submit(prepare, work)] = config
            while ready and not abort and len(pending) < self.pool.size:
                config, compiled = ready.popleft()
                job = self._job(kernel, space.as_dict(config), o.rep_ms, compiled)
                pending[self.pool.submit(self.measure_fn, job, o.timeout)] = config
            if not pending and not (compiling and not abort) and not (ready and not abort):
                break
            done, _ = wait(list(pending) + (list(compiling) if not abort else []), return_when=FIRST_COMPLETED)
            for fut in done:
                if fut in compiling:
                    config = compiling.pop(fut)
                    try:
                        tag, value = fut.result()
                    except Exception:  # the compiled kernel could not travel back: the worker compiles it
                        tag, value = "ok", None
                    if tag == "ok":
                        ready.append((config, value))
                    else:
                        failed(config, f"compile failed: {value}")
                    continue
                config = pending.pop(fut)
                out = fut.result()
                if out.ok:
                    measured[config] = out.value
                    searcher.tell(config, out.value.median_us)
                    report(config, True, us=out.value.median_us)
                else:
                    failed(config, out.reason)
        for fut in compiling:
            fut.cancel()
        wall = time.perf_counter() - t0
        base = dict(name=name, key=key, default_knobs=default, evaluated=len(searcher.history),
                    failed=len(failures), failures=failures, method=method)
        if not measured:
            why = abort or (failures[0]["reason"] if failures else "no candidate to measure")
            r = KernelResult(status="failed", wall_s=wall, note=why, **base)
            self.on_event("done", name=name, result=r)
            return r
        best, best_m, default_m = self._confirm(kernel, space, measured)
        wall = time.perf_counter() - t0
        stats = {"median_us": best_m.median_us, **{k: v for k, v in best_m.stats.items() if k != "median_us"},
                 "default_us": default_m.median_us if default_m else None, "default_knobs": default,
                 "evaluated": len(searcher.history), "failed": len(failures), "method": method, "wall_s": wall,
                 "budget": o.budget, "seed": o.seed, "registers": best_m.registers, "spill_bytes": best_m.spill_bytes}
        self.cache.put(Entry(key, space.as_dict(best), stats, tuple(failures), time.time()))
        r = KernelResult(status="tuned", knobs=space.as_dict(best), best_us=best_m.median_us,
                         default_us=stats["default_us"], wall_s=wall, **base)
        self.on_event("done", name=name, result=r)
        return r

    def _confirm(self, kernel, space, measured: dict):
        """Re-time the best few and the default, longer, in interleaved rounds; the fastest wins.

        One timing each, one after another, let the GPU's clock drift decide: on an H100 a
        16384 x 6144 x 4096 GEMM's pick confirmed so was 10% slower than the default when both
        were re-timed in interleaved rounds (power-limited clocks fall under a long GEMM load
        and recover between kernels). Each round times every finalist once, in a rotated order.
        With the default among them, a finalist's score is the median over rounds of its time
        over the default's time *in the same round*, which cancels the drift between rounds (a
        minimum of medians did not: one lucky round made a pick that re-timed 5.9% slower than
        the default at that same shape, session 6), and it must beat the default by `min_gain`.
        Without the default, the minimum of each finalist's medians decides."""
        o = self.options
        ranked = sorted(measured, key=lambda c: measured[c].median_us)
        finalists = ranked[:max(1, o.confirm)]
        if space.default in measured and space.default not in finalists:
            finalists.append(space.default)
        again = {}
        rounds: list[dict] = []
        for rnd in range(max(1, o.confirm_rounds)):
            k = rnd % len(finalists)
            times = {}
            for c in finalists[k:] + finalists[:k]:
                out = self.pool.submit(self.measure_fn, self._job(kernel, space.as_dict(c), o.confirm_rep_ms),
                                       o.timeout).result()
                if out.ok:
                    times[c] = out.value.median_us
                    if c not in again or out.value.median_us < again[c].median_us:
                        again[c] = out.value
            rounds.append(times)
        if not again:  # the finalists failed the second time: keep the first measurements
            again = {c: measured[c] for c in finalists}
        d = again.get(space.default)
        if d is None:
            best = min(again, key=lambda c: again[c].median_us)
            return best, again[best], d

        def score(c) -> float:  # median over rounds of time / the default's time in that round
            ratios = sorted(r[c] / r[space.default] for r in rounds if c in r and space.default in r)
            return ratios[len(ratios) // 2] if ratios else again[c].median_us / d.median_us

        best = min(again, key=score)
        if score(best) > 1 - o.min_gain:
            best = space.default  # a gain inside the timing noise is no reason to leave the heuristic
        return best, again[best], d
