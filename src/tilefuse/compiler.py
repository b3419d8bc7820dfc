"""The pipeline, stage by stage: capture -> Graph IR -> rewrites -> plan -> Loop IR -> program."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .frontend.capture import export, to_graph
from .graph import ir
from .graph.fusion import Plan, plan
from .graph.rewrites import Fired, run_rewrites
from .loop.lower import Lowered, lower_step
from .runtime.program import Program
from .tune.lookup import tuned_schedule


@dataclass
class Compiled:
    """Every stage of one compilation, printable, plus the runnable program."""

    captured: ir.Graph
    graph: ir.Graph
    fired: list[Fired]
    plan: Plan
    kernels: dict[str, Lowered]
    program: Program
    timings: dict = field(default_factory=dict)


def compile_stages(fn, example_inputs, *, expr: str | None = None, arch: str | None = None) -> Compiled:
    import time

    t0 = time.perf_counter()
    ep = export(fn, example_inputs, expr=expr)
    t1 = time.perf_counter()
    captured = to_graph(ep, expr=expr)
    graph, fired = run_rewrites(captured)
    p = plan(graph)
    kernels = {}
    for i, step in enumerate(p.steps):
        if step.family == "mapreduce":
            kernels[step.name] = lower_step(graph, step, f"tf_{step.name}")
    t2 = time.perf_counter()
    program = Program(graph, p, kernels, out_spec=ep.call_spec.out_spec, arch=arch, schedules=tuned_schedule)
    return Compiled(captured, graph, fired, p, kernels, program,
                    {"export_s": t1 - t0, "lower_s": t2 - t1})


def compile(fn, example_inputs, *, arch: str | None = None, graphs: bool | None = None):
    """Compile a callable or nn.Module for these example inputs; returns a callable like it.

    The result runs generated CUDA kernels on CUDA tensors and the Loop IR interpreter on
    CPU tensors. Shapes and dtypes are fixed to the examples'. On CUDA, calls replay a
    captured CUDA graph after the first (`graphs=False` or TILEFUSE_CUDA_GRAPHS=0 turns
    that off); a result you still hold is never overwritten by a later call.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    c = compile_stages(fn, tuple(example_inputs), arch=arch)
    if graphs is not None:
        c.program.graphs = graphs
    if any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
        c.program.prepare("cuda")
    c.program.stages = c
    return c.program
