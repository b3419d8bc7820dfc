"""Tune a program's kernels from a benchmark script, as `tilefuse tune` does (`--tune` flags).

The picks go to the tuning cache (TILEFUSE_CACHE_DIR), where `tilefuse.compile` finds them:
tune first, then compile and time.
"""
from __future__ import annotations


def make_tuner():
    """A tuner as `tilefuse tune` makes one: a worker process on GPU 0, the on-disk cache,
    candidates compiled ahead on the CPU cores. Close it with `close(tuner)`."""
    from tilefuse.tune.cache import TuneCache
    from tilefuse.tune.command import compile_jobs
    from tilefuse.tune.device import cuda_device
    from tilefuse.tune.tuner import TuneOptions, Tuner
    from tilefuse.tune.worker import WorkerPool

    return Tuner(WorkerPool([0]), cuda_device(0), TuneCache(), TuneOptions(jobs=compile_jobs()))


def tune(tuner, module, inputs) -> dict:
    """Tune every kernel of `module` on `inputs` (a cache hit when tuned before): kernel -> what
    the tuner said (status, default and best us, knobs, wall s)."""
    from tilefuse.compiler import compile_stages
    from tilefuse.tune.command import collect

    results = tuner.tune(collect([compile_stages(module, inputs)]))
    return {r.name: {"status": r.status, "default_us": r.default_us, "best_us": r.best_us, "knobs": r.knobs,
                     "wall_s": r.wall_s} for r in results}


def close(tuner):
    tuner.close()
    tuner.pool.close()
