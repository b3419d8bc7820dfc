"""Fake benchmark functions for the tuner tests, importable without torch (worker processes
import this module to unpickle a job's function, inside the job's watchdog time)."""
from __future__ import annotations

import os
import time

from tilefuse.tune.measure import Measurement


def fake_time(k: dict) -> float:
    """Fastest: smem, 512 threads; every knob moves the time a little."""
    t = 10.0 + abs(k["threads"] - 512) / 256 + {"smem": 0, "regs": 1, "stream": 2}[k["stage"]]
    return t + 0.1 * k["min_blocks"] / 8 + 0.01 * k["unroll"]


def crashy_measure(job):
    """Crashes for 1024-thread smem candidates, hangs for 64-thread smem ones."""
    if job.knobs["threads"] == 1024 and job.knobs["stage"] == "smem":
        os._exit(9)
    if job.knobs["threads"] == 64 and job.knobs["stage"] == "smem":
        time.sleep(30)
    return Measurement(fake_time(job.knobs), {"reps": 1})
