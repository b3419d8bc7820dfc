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


# ---------------------------------------------------------------- compile-ahead and GEMM fakes

MADE_IN: list = []   # pids of the processes that compiled the kernels a measurement ran


class AheadKernel(InterpKernel):
    """An InterpKernel that remembers the process that compiled it."""

    def __init__(self, kernel, schedule):
        super().__init__(kernel, schedule)
        self.pid = os.getpid()

    def __call__(self, *tensors):
        MADE_IN.append(self.pid)
        return super().__call__(*tensors)


def ahead_compile(kernel, schedule, arch):
    """Fails to 'compile' 64-thread schedules, as NVRTC would a kernel over its resources."""
    if schedule.threads == 64:
        raise RuntimeError("NVRTC: too many resources requested for launch\nsecond line")
    return AheadKernel(kernel, schedule)


class FakeGemm:
    """A 'compiled' GEMM on CPU tensors (plain epilogue): A @ B in float32, with bugs on
    purpose: bn=96 schedules scale one 64x64 block by 1.05, 5-stage ones leave the last row
    of the output unwritten."""

    def __init__(self, problem, schedule):
        self.problem, self.schedule = problem, schedule

    def __call__(self, a, b, **tensors):
        (name,) = [o.name for o in self.problem.out_epilogue.outputs]
        out = tensors[name]
        bt = b.transpose(-1, -2) if self.problem.b_major == "K" else b
        y = (a.float() @ bt.float()).to(out.dtype)
        if self.schedule.bn == 96:
            y[..., :64, :64] = (y[..., :64, :64].float() * 1.05).to(out.dtype)
        if self.schedule.stages == 5:
            out[..., :-1, :].copy_(y[..., :-1, :])
        else:
            out.copy_(y)
        return out


def fake_gemm_compile(task, schedule, arch):
    return FakeGemm(task.problem, schedule)


def _register_more():
    from tilefuse.tune import gemm, mapreduce
    from tilefuse.tune.families import register_family

    register_family("interp-cpu-ahead", mapreduce.space, mapreduce.build, compile_fn=ahead_compile, version="test",
                    portable=True)
    register_family("gemm-cpu", gemm.space, gemm.build, compile_fn=fake_gemm_compile, problem_fn=gemm.gemm_check,
                    knobs_fn=gemm.knobs_of, describe_fn=gemm.describe, version="test")


_register_more()
