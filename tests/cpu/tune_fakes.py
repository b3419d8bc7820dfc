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


class InterpKernel:
    """A 'compiled kernel' that runs the Loop IR interpreter on CPU tensors, with bugs on
    purpose: group=2 schedules leave the last output element unwritten, stream-stage
    schedules scale their outputs by 1.01."""

    def __init__(self, kernel, schedule):
        self.kernel, self.schedule = kernel, schedule

    def __call__(self, *tensors):
        from tilefuse.loop.interp import run_kernel
        from tilefuse.tensors import to_numpy, to_torch

        named = dict(zip((b.name for b in self.kernel.params), tensors))
        outs = run_kernel(self.kernel, {b.name: to_numpy(named[b.name]) for b in self.kernel.inputs})
        for name, a in outs.items():
            t = to_torch(a)
            if self.schedule.stage == "stream":
                t = (t.float() * 1.01).to(t.dtype)
            if self.schedule.group == 2:
                named[name].view(-1)[:-1].copy_(t.view(-1)[:-1])
            else:
                named[name].copy_(t)


def interp_compile(kernel, schedule, arch):
    return InterpKernel(kernel, schedule)


def _register():
    from tilefuse.tune import mapreduce
    from tilefuse.tune.families import register_family

    register_family("interp-cpu", mapreduce.space, mapreduce.build, compile_fn=interp_compile, version="test")


_register()
