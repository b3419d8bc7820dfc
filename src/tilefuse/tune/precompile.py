"""Compile candidates ahead of the benchmark worker, on every CPU core.

NVRTC takes a few hundred milliseconds per kernel and needs no GPU. When the candidates
are known in advance (an exhaustive search), compiling them all in parallel processes
first fills the on-disk cubin cache, and the worker's compile becomes a cache hit.
A candidate that fails to compile here fails again, with its reason, in the worker.
"""
from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor


def _compile_one(job) -> bool:
    family, kernel, knobs, arch = job
    from .families import get_family

    fam = get_family(family)
    try:
        fam.compile(kernel, fam.build(kernel, knobs, arch), arch)
    except Exception:  # reported by the worker, which compiles it again
        return False
    return True


def precompile(kernel, knob_list: list[dict], arch: str, jobs: int) -> int:
    """Compile every knob set for `kernel` into the cubin cache; returns how many compiled."""
    if jobs <= 0 or not knob_list:
        return 0
    work = [(kernel.family, kernel, k, arch) for k in knob_list]
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        return sum(ex.map(_compile_one, work, chunksize=max(1, len(work) // (4 * jobs))))
