"""Benchmark workers: one isolated process per GPU that survives the candidates it runs.

A candidate schedule can fail to compile, read out of bounds (an illegal address leaves
the CUDA context unusable, or kills the process) or never finish. None of that may stop a
search, so candidates run in a child process (multiprocessing "spawn": a fresh
interpreter, no CUDA state inherited) that the parent watches:

- the function raises: the child reports the error and keeps serving; if the error
  leaves CUDA unusable (`Fatal`, or any message naming a CUDA error) it reports, then exits;
- the child dies (segfault, os._exit, killed by the OOM killer): the parent sees the pipe
  close, records the exit code or signal, and starts a new child for the next job;
- the job outlives its deadline: the parent kills the child (the watchdog) and starts a
  new one.

Each case becomes an `Outcome` with ok=False and a one-line reason. Jobs are a module-level
function plus one picklable payload; the function runs in the child.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable


PRELOAD = ("tilefuse.loop.ir", "tilefuse.tune.measure")  # what every job's payload needs


class Fatal(RuntimeError):
    """Raised by a job when the process must not run another one (e.g. a sticky CUDA error)."""


@dataclass(frozen=True)
class Outcome:
    ok: bool
    value: Any = None
    reason: str = ""    # why it failed: one line
    seconds: float = 0.0


def _is_fatal(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return isinstance(e, Fatal) or "CUDA error" in text or "CUDA_ERROR" in text or "CudaError" in text


def _one_line(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:500]


def _serve(conn, env: dict, preload: tuple = ()):
    """The child's loop: run (fn, payload) jobs until told to stop (None) or a fatal error."""
    os.environ.update(env)
    for module in preload:  # imports before "ready": the watchdog times jobs, not start-up
        importlib.import_module(module)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        fn, payload = job
        try:
            conn.send(("ok", fn(payload)))
        except BaseException as e:  # noqa: BLE001 - every failure is a reported outcome
            fatal = _is_fatal(e)
            try:
                conn.send(("error", _one_line(e), fatal))
            except Exception:
                os._exit(4)
            if fatal:
                conn.close()
                os._exit(3)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Worker:
    """One child process; `run` is synchronous and never raises for a bad job."""

    def __init__(self, gpu: int | None = None, *, timeout: float = 60.0, start_timeout: float = 120.0,
                 env: dict | None = None, preload: tuple = PRELOAD):
        self.gpu = gpu
        self.preload = tuple(preload)
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.env = dict(env or {})
        if gpu is not None:
            self.env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        self._proc = None
        self._conn = None
        self.restarts = 0  # children started after the first

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> str | None:
        """Start a child; an error line if it did not come up."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.env, self.preload), daemon=True,
                           name=f"tilefuse-bench-{'cpu' if self.gpu is None else self.gpu}")
        if self._proc is not None:
            self.restarts += 1
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        try:
            if parent.poll(self.start_timeout):
                tag, _ = parent.recv()
                if tag == "ready":
                    return None
        except (EOFError, OSError):
            pass
        self._kill()
        return f"benchmark worker did not start ({describe_exit(proc.exitcode)})"

    def _kill(self):
        proc, conn = self._proc, self._conn
        if proc is not None and proc.is_alive():
            proc.kill()
        if proc is not None:
            proc.join(5)
        if conn is not None:
            conn.close()
        self._conn = None

    def _alive(self) -> bool:
        return self._proc is not None and self._conn is not None and self._proc.is_alive()

    def run(self, fn: Callable, payload, timeout: float | None = None) -> Outcome:
        timeout = self.timeout if timeout is None else timeout
        if not self._alive():
            err = self._start()
            if err:
                return Outcome(False, reason=err)
        t0 = time.perf_counter()
        try:
            self._conn.send((fn, payload))
        except (BrokenPipeError, OSError) as e:
            self._kill()
            return Outcome(False, reason=f"benchmark worker unreachable: {_one_line(e)}")
        try:
            ready = self._conn.poll(timeout)
        except (EOFError, OSError):
            ready = True
        if not ready:
            self._kill()
            return Outcome(False, reason=f"timed out after {timeout:g} s (worker killed)",
                           seconds=time.perf_counter() - t0)
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            code = self._proc.exitcode
            self._kill()
            return Outcome(False, reason=f"benchmark worker died ({describe_exit(code)})",
                           seconds=time.perf_counter() - t0)
        dt = time.perf_counter() - t0
        if msg[0] == "ok":
            return Outcome(True, msg[1], seconds=dt)
        _, reason, fatal = msg
        if fatal:  # the child exits by itself; reap it
            self._proc.join(5)
            self._kill()
        return Outcome(False, reason=reason, seconds=dt)

    def close(self):
        if self._alive():
            try:
                self._conn.send(None)
                self._proc.join(5)
            except (BrokenPipeError, OSError):
                pass
        self._kill()
        self._proc = None


class WorkerPool:
    """One Worker per GPU (or `n` CPU workers for tests); `submit` gives a Future of an Outcome."""

    def __init__(self, gpus: list[int | None], **worker_kw):
        self.workers = [Worker(g, **worker_kw) for g in gpus]
        self._idle: queue.Queue = queue.Queue()
        for w in self.workers:
            self._idle.put(w)
        self._exec = ThreadPoolExecutor(max_workers=len(self.workers), thread_name_prefix="tilefuse-bench")
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self.workers)

    def _run(self, fn, payload, timeout):
        w = self._idle.get()
        try:
            return w.run(fn, payload, timeout)
        finally:
            self._idle.put(w)

    def submit(self, fn: Callable, payload, timeout: float | None = None) -> Future:
        return self._exec.submit(self._run, fn, payload, timeout)

    def close(self):
        self._exec.shutdown(wait=True)
        for w in self.workers:
            w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
