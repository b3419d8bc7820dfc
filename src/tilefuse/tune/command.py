"""`tilefuse tune -c EXPR`: tune every distinct kernel of a program on this machine's GPUs.

Shows a progress bar per kernel with its best time so far against the heuristic default,
and one for the whole program (the sum of the kernels' best times against the sum of
their defaults); prints a table of the picks at the end. Picks go to the tuning cache,
where `tilefuse run`, `tilefuse.compile` and `--ir schedule` find them.
"""
from __future__ import annotations

import os

from .measure import measure
from .tuner import KernelResult, TuneOptions, Tuner
from .worker import WorkerPool

MEASURE = measure   # what a worker runs per candidate (tests substitute a fake)
POOL = WorkerPool   # gpus -> pool of workers
JOBS = None         # CPU processes compiling candidates ahead (None: the cores but one, at most 8)


def compile_jobs() -> int:
    if JOBS is not None:
        return JOBS
    return max(0, min(8, (os.cpu_count() or 1) - 1))


def check_gpus(n: int):
    """The Devices of GPUs 0..n-1 (one model), or a ValueError saying why not."""
    import torch

    from .device import cuda_device

    if not torch.cuda.is_available():
        raise ValueError("tune measures kernels on a GPU, and none is visible (torch.cuda.is_available() is False)")
    have = torch.cuda.device_count()
    if not 1 <= n <= have:
        raise ValueError(f"--gpus {n}: this machine has {have} visible GPU(s)")
    devices = [cuda_device(i) for i in range(n)]
    if len({(d.name, d.capability) for d in devices}) > 1:
        raise ValueError(f"--gpus {n}: the GPUs differ ({', '.join(sorted({d.name for d in devices}))}); "
                         f"tuned knobs are per GPU model, so tune on one model at a time")
    return devices


class ProgressView:
    """Turns the tuner's events into rich progress bars."""

    def __init__(self, progress, n_kernels: int):
        self.p = progress
        self.tasks: dict = {}
        self.totals: dict = {}
        self.best: dict = {}      # kernel -> best us so far
        self.default: dict = {}   # kernel -> default us
        self.overall = progress.add_task("[bold]program", total=n_kernels, best="")

    def _overall_text(self) -> str:
        both = [k for k in self.best if self.default.get(k)]
        if not both:
            return ""
        b, d = sum(self.best[k] for k in both), sum(self.default[k] for k in both)
        return f"kernels {b:.1f} us vs default {d:.1f} us ({d / b:.2f}x)"

    def __call__(self, kind: str, name: str, **info):
        if kind == "start":
            self.tasks[name] = self.p.add_task(f"{name} [{info['method']}]", total=info["total"], best="")
            self.totals[name] = info["total"]
        elif kind == "trial":
            if info.get("default_us"):
                self.default[name] = info["default_us"]
            if info.get("best_us"):
                self.best[name] = info["best_us"]
            text = ""
            if name in self.best:
                text = f"best {self.best[name]:.1f} us"
                if self.default.get(name):
                    text += f" ({self.default[name] / self.best[name]:.2f}x default)"
            self.p.update(self.tasks[name], completed=info["done"], best=text)
            self.p.update(self.overall, best=self._overall_text())
        elif kind == "done":
            r: KernelResult = info["result"]
            if r.best_us:
                self.best[name] = r.best_us
            if r.default_us:
                self.default[name] = r.default_us
            if name not in self.tasks:  # a cache hit or a kernel seen before: no search ran
                self.tasks[name] = self.p.add_task(name, total=1, best="")
                self.totals[name] = 1
            self.p.update(self.tasks[name], completed=self.totals[name], best=_summary(r))
            self.p.advance(self.overall)
            self.p.update(self.overall, best=self._overall_text())


def _summary(r: KernelResult) -> str:
    if r.status == "failed":
        return f"failed: {r.note}"
    s = f"{r.best_us:.1f} us" if r.best_us else ""
    if r.speedup:
        s += f" ({r.speedup:.2f}x default)"
    return f"{r.status}: {s}" if s else r.status


def collect(stages: list) -> dict:
    """name -> tunable kernel, for every generated kernel of the compiled programs (one per
    dynamo graph for a model): the map-reduce kernels and the planned GEMMs (but those of up
    to 8 rows, which programs run in the GEMV: codegen/gemv.py)."""
    from ..codegen import gemv
    from .gemm import GemmTask

    kernels = {}
    for i, st in enumerate(stages):
        prefix = f"g{i}." if len(stages) > 1 else ""
        for name, lk in st.kernels.items():
            kernels[prefix + lk.kernel.name] = lk.kernel
        for name, lg in st.gemms.items():
            problem = lg.problem()
            if gemv.takes(problem):  # a program runs it in the GEMV, whose knobs the tuner does not search
                continue
            kernels[prefix + lg.epilogue.name] = GemmTask(problem, name=lg.epilogue.name)
    return kernels


def run(args, build) -> int:
    """The subcommand; `build(args)` compiles the program and returns its stages, a list of
    `compiler.Compiled` (cli._tune_stages: one for -c, one per dynamo graph for --model)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..cli import make_console
    from .cache import TuneCache

    console = make_console()
    devices = check_gpus(args.gpus)
    if args.arch:
        from ..runtime.nvrtc import normalize_arch

        if normalize_arch(args.arch) != devices[0].arch:
            raise ValueError(f"--arch {args.arch}: tune measures on this GPU, which is {devices[0].arch}")
    kernels = collect(build(args))
    if not kernels:
        console.print("no fused kernels in this program: nothing to tune")
        return 0
    options = TuneOptions(budget=args.budget, polish=args.polish, exhaustive=args.exhaustive, threshold=args.threshold,
                          seed=args.seed, timeout=args.timeout, force=args.force, jobs=compile_jobs())
    cache = TuneCache()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[best]}"), console=console) as progress:
        view = ProgressView(progress, len(kernels))
        with POOL(list(range(args.gpus)), timeout=args.timeout) as pool:
            with Tuner(pool, devices[0], cache, options, on_event=view, measure_fn=MEASURE) as tuner:
                results = tuner.tune(kernels)
    console.print(results_table(results, f"tilefuse tune on {devices[0]}: cache {cache.path}"))
    return 0 if all(r.status != "failed" for r in results) else 2


def results_table(results: list, title: str):
    """One row per kernel (its result, default and tuned times), then a line per kernel with
    the knobs the tuner changed and what the search cost: lines wrap where a table column
    would cut them (an 80-column pipe cut a knobs column a word a line)."""
    from rich.console import Group
    from rich.table import Table

    table = Table(title=title)
    for col in ("kernel", "result", "default us", "tuned us", "speedup"):
        table.add_column(col, overflow="fold")
    lines = []
    for r in results:
        fmt = lambda x: f"{x:.1f}" if x else "-"  # noqa: E731
        table.add_row(r.name, r.status if r.status != "failed" else f"failed: {r.note}", fmt(r.default_us),
                      fmt(r.best_us), f"{r.speedup:.2f}x" if r.speedup else "-")
        lines.append(f"{r.name}: {_knobs_text(r.knobs, r.default_knobs)}  "
                     f"({r.evaluated} tried, {r.failed} failed, {r.wall_s:.1f} s)")
    return Group(table, "knobs changed from the default:", *lines)


def _knobs_text(knobs: dict | None, default: dict | None = None) -> str:
    """The picked knobs that differ from the default schedule's (a map-reduce schedule has 11,
    which wrapped a word a line in an 80-column pipe), or all of them where no default is known."""
    if not knobs:
        return "-"
    if default is None:
        return " ".join(f"{k}={v}" for k, v in knobs.items())
    changed = " ".join(f"{k}={v}" for k, v in knobs.items() if default.get(k) != v)
    return changed or "(the default)"
