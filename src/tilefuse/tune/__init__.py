"""The autotuner: knob spaces per kernel family, SP-MCTS search, isolated benchmark workers,
and a SQLite cache keyed by device and kernel structure (docs/tuning.md).

    space.py     Space: named knob dimensions, candidate values, validity
    search.py    SP-MCTS and exhaustive search (ask/tell)
    families.py  register_family: each kernel family's space and schedule builder
    mapreduce.py the map-reduce family's knobs
    gemm.py      the sm_90a GEMM's knobs, references and cache key (GemmTask)
    worker.py    benchmark worker processes: crashes, hangs and errors become failed candidates
    measure.py   what a worker does with a candidate: compile, check, time
    reference.py inputs and float64 / interpreter references for a Loop IR kernel
    cache.py     the tuning cache (SQLite, WAL)
    lookup.py    which schedule a kernel gets: tuned (a cache hit) or the heuristic default;
                 tuned_gemm_schedule(problem, arch, device) for the planner
    tuner.py     tuning a kernel or a program: search + workers + cache

Importing this package is cheap (no torch): worker processes import it first.
"""
from .families import Family, families, get_family, register_family  # noqa: F401
from .space import Dim, Space  # noqa: F401
