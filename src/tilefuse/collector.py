"""Python's cyclic garbage collector held off while tilefuse needs it off, from any thread.

Two holders: a CUDA-graph capture, inside which no finalizer may run (runtime/graphs.py), and a
compile, whose many small objects set off full collections that walk every object of the
process, a model's included (compiler.py: 0.55-0.62 s inside 2 of 5 compiles of a 32-layer
Llama, bench/LOG_blocks.md, session 39). The switch is process-wide, so holds are counted:
the collector comes back on when the last hold ends, and only if it was on when the first
began. A compile ending on one thread then cannot turn it on under another thread's capture,
and a caller who turned it off keeps it off."""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_holds = 0
_was_on = False


@contextlib.contextmanager
def paused():
    global _holds, _was_on
    with _lock:
        if _holds == 0:
            _was_on = gc.isenabled()
            gc.disable()
        _holds += 1
    try:
        yield
    finally:
        with _lock:
            _holds -= 1
            if _holds == 0 and _was_on:
                gc.enable()
