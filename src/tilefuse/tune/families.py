"""Kernel families the tuner knows: each brings its knob space and how knobs become a schedule.

    register_family("gemm_sm90", space_fn, build_fn, compile_fn=..., problem_fn=...)

space_fn(kernel, arch) -> Space           the knobs, the heuristic default among them
build_fn(kernel, knobs, arch) -> schedule the family's schedule object (ValueError: invalid)
compile_fn(kernel, schedule, arch) -> f   f(*tensors in kernel.params order) launches it
problem_fn(kernel, seed, device) -> Problem
                                          inputs (NumPy arrays or tensors; moved to `device`)
                                          and references to check a candidate
knobs_fn(schedule) -> dict                the knobs of a schedule (to print a cached pick)
describe_fn(kernel) -> (hash, signature)  the cache key's kernel part: a structural hash
                                          (names must not change it) and the shapes/dtypes
version                                   bump it when the space or the generator changes
                                          meaning: tuned entries of other versions are ignored
portable                                  compiled kernels may be pickled to the benchmark
                                          worker (no process-local state such as pointers)

The map-reduce family (tune/mapreduce.py) and the sm_90a GEMM (tune/gemm.py) are
registered here; the compile and problem functions default to the Loop IR path (codegen
render + NVRTC; the Loop IR interpreter as the reference).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str
    space: Callable
    build: Callable
    compile: Callable
    problem: Callable
    knobs: Callable
    describe: Callable
    version: str = "1"
    portable: bool = False  # its compiled kernels survive pickling into another process (compile-ahead)


_FAMILIES: dict[str, Family] = {}


def _compile_loop_kernel(kernel, schedule, arch):
    from ..runtime.launch import compile_kernel

    return compile_kernel(kernel, arch=arch, schedule=schedule)


def _loop_problem(kernel, seed, device="cpu"):
    from .reference import loop_problem

    return loop_problem(kernel, seed)  # NumPy inputs and references: the device is measure's business


def _describe_loop_kernel(kernel) -> tuple[str, str]:
    from ..loop.canon import structural_hash
    from .cache import signature

    return structural_hash(kernel), signature(kernel)


def _dataclass_knobs(schedule) -> dict:
    return asdict(schedule) if is_dataclass(schedule) else dict(schedule)


def register_family(name: str, space_fn: Callable, build_fn: Callable, *, compile_fn: Callable = _compile_loop_kernel,
                    problem_fn: Callable = _loop_problem, knobs_fn: Callable = _dataclass_knobs,
                    describe_fn: Callable = _describe_loop_kernel, version: str = "1", portable: bool = False) -> Family:
    fam = Family(name, space_fn, build_fn, compile_fn, problem_fn, knobs_fn, describe_fn, version, portable)
    _FAMILIES[name] = fam
    return fam


def get_family(name: str) -> Family:
    if name not in _FAMILIES:
        raise ValueError(f"the tuner has no knob space for the {name!r} kernel family "
                         f"(known: {', '.join(sorted(_FAMILIES)) or 'none'})")
    return _FAMILIES[name]


def families() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def _register_builtin():
    from . import gemm, mapreduce

    register_family("mapreduce", mapreduce.space, mapreduce.build, knobs_fn=mapreduce.knobs_of, version="7")
    # mapreduce version 2: l2_hints joined the space and 16-32 KB norm rows got a new default;
    # version 3: two_pass joined it and LayerNorm's short rows got a new default;
    # version 4: batch joined it, and RMSNorm's and LayerNorm's short rows take a batch of 2;
    # version 5: the generator stores a value in the pass that makes it (keep.Moved), sizes
    # staging by the widest chunk, and mid-length rows (1032-6143 bf16 columns) got new defaults;
    # version 6: LayerNorm's one-pass variance folds its groups about the running mean;
    # version 7: a column kernel's batch of neighbouring rows (vector loads and stores a column)
    # joined the space, and 16-bit column kernels take a batch of 2 by default
    register_family(gemm.FAMILY, gemm.space, gemm.build, compile_fn=gemm.compile_task, problem_fn=gemm.gemm_check,
                    knobs_fn=gemm.knobs_of, describe_fn=gemm.describe, version="2", portable=True)
    # gemm version 2: rings deeper than 8 stages joined the space (picks of version 1 are re-tuned)


_register_builtin()
