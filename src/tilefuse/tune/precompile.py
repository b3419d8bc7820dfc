"""Compile candidates ahead of the benchmark worker, in parallel CPU processes.

Rendering and NVRTC take a few hundred milliseconds per candidate and need no GPU, while
the worker has one GPU to keep busy. So the tuner (with `jobs` > 0) hands each proposed
candidate to a pool of CPU processes first: `prepare` builds the schedule and compiles it,
which fills the on-disk cubin cache, and returns the compiled kernel itself when its family
says it is portable (a GemmKernel is: the worker then neither renders nor compiles). A compile error
comes back as the candidate's failure reason, without spending the worker's time.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from concurrent.futures import ProcessPoolExecutor


def prepare(job) -> tuple[str, object]:
    """("ok", compiled kernel or None when it cannot travel) or ("error", one-line reason).
    `job` is (Family, kernel, knobs, arch): the family travels itself (its functions by
    reference), so families registered outside tilefuse work in these processes too."""
    fam, kernel, knobs, arch = job
    try:
        fn = fam.compile(kernel, fam.build(kernel, knobs, arch), arch)
    except Exception as e:  # the candidate's failure, reported by the tuner
        first = (str(e).strip().splitlines() or [""])[0]
        return "error", f"{type(e).__name__}: {first}"[:400] + _where(e)
    if not fam.portable:  # e.g. ctypes state: the worker compiles it again (a cubin cache hit)
        return "ok", None
    try:
        pickle.dumps(fn)
    except Exception:
        return "ok", None
    return "ok", fn


def _where(e: BaseException) -> str:
    """ " (raised at file:line in function, called from ...)" of the innermost frame and of the
    innermost tilefuse frame: a failure in another process shows only this line, and a message
    such as PyTorch's schema parser's names no caller."""
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    if not frames:
        return ""

    def at(t) -> str:
        code = t.tb_frame.f_code
        return f"{code.co_filename}:{t.tb_lineno} in {code.co_name}"

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = [t for t in frames if os.path.abspath(t.tb_frame.f_code.co_filename).startswith(package + os.sep)]
    where = f" (raised at {at(frames[-1])}"
    if ours and ours[-1] is not frames[-1]:
        where += f", called from {at(ours[-1])}"
    return where + ")"


def compiler_pool(jobs: int) -> ProcessPoolExecutor:
    """`jobs` spawned processes (no CUDA state is inherited or created: NVRTC needs no GPU)."""
    return ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))


def warm(_=None) -> bool:
    """Import what compiling needs (torch, the code generators, NVRTC): a pool's start-up."""
    from ..runtime import gemm, launch  # noqa: F401

    return True
