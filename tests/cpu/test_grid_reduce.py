"""Grid reductions: a full reduction of a row kernel's per-row values fused into that kernel.

Grid reductions are opt-in (TILEFUSE_GRID_REDUCE=1, set by this module's fixture) until their
CUDA path has run on a GPU. Properties checked without a GPU:
- cross-entropy with reduction="mean" or "sum" (and a sum of a softmax's row maxima) plans as
  ONE map-reduce kernel writing only the scalar; reduction="none" is unchanged; a reduction
  over rows that cannot merge partials (a log-sum-exp over rows) stays a second kernel;
- through the Loop IR interpreter the fused kernel gives bit for bit what the row kernel and
  the finishing kernel gave when run one after the other (the CPU path is unchanged), at odd
  row counts and row counts that are no multiple of the CTA's rows;
- the kernel passes verify, its structural hash ignores names and its canonical form keeps
  the grid loop after the row loop;
- the CUDA source compiles for sm_90a and sm_80 without spills; it takes one workspace
  pointer (no static __device__ counter), resets every counter it counts into, and its
  workspace layout fits every schedule's groups;
- the tuner tunes the fused kernel through its real measure path, each candidate launched on a
  workspace of its own as the runtime's launchers provide one (size, zeros, no reset between
  launches), and a candidate that leaves its workspace dirty fails its check.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tilefuse.check import compare, float64_reference, flatten
from tilefuse.codegen import mapreduce
from tilefuse.codegen.mapreduce import default_schedule, render, workspace_layout
from tilefuse.compiler import compile as tf_compile, compile_stages
from tilefuse.loop import canon, ir
from tilefuse.loop.interp import run_kernel
from tilefuse.loop.lower import lower_step
from tilefuse.loop.verify import verify
from tilefuse.runtime.launch import compile_source_only
from tilefuse.tensors import to_numpy, to_torch


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cubin"))
    monkeypatch.setenv("TILEFUSE_GRID_REDUCE", "1")  # opt-in until checked on a GPU (graph/fusion.py)


def test_grid_reductions_are_off_unless_asked_for(monkeypatch):
    """Without TILEFUSE_GRID_REDUCE=1 the plan is the one from before: the row kernel, then the
    finishing kernel over its per-row values."""
    monkeypatch.delenv("TILEFUSE_GRID_REDUCE")
    stages = compile_stages(_xent, _ce_inputs(7, 1000))
    assert [s.tail for s in _mapreduce_steps(stages)] == [None, None]


def _xent(x, t):
    return F.cross_entropy(x, t)


def _xent_sum(x, t):
    return F.cross_entropy(x, t, reduction="sum")


def _xent_none(x, t):
    return F.cross_entropy(x, t, reduction="none")


def _rowmax_sum(x):
    return torch.softmax(x, -1).amax(-1).sum()


def _lse_over_rows(x):
    return torch.logsumexp(x.amax(-1), 0)


def _softmax_over_rows(x):
    return torch.softmax(x.amax(-1), 0)


def _ce_inputs(n, c, ignore=True):
    x = torch.randn(n, c).bfloat16()
    t = torch.randint(0, c, (n,))
    if ignore and n > 2:
        t[1] = -100  # an ignored row: the mean divides by the valid rows only
    return x, t


def _mapreduce_steps(stages):
    return [s for s in stages.plan.steps if s.family == "mapreduce"]


@pytest.mark.parametrize("fn", [_xent, _xent_sum], ids=["mean", "sum"])
@pytest.mark.parametrize("shape", [(7, 1000), (333, 257), (2, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_cross_entropy_reduction_is_one_kernel_with_a_grid_reduction(fn, shape):
    stages = compile_stages(fn, _ce_inputs(*shape))
    (k,) = _mapreduce_steps(stages)
    assert k.tail is not None and k.outputs == list(stages.graph.outputs)
    assert not [s for s in stages.plan.steps if s.family == "extern"]
    assert "grid reduction" in str(stages.plan)
    kernel = stages.kernels[k.name].kernel
    assert ir.grid_parts(kernel) is not None and len(kernel.body) == 2
    assert [b.name for b in kernel.params if b.role == "out"] == list(stages.graph.outputs)
    verify(kernel)


def test_reduction_none_has_no_grid_reduction():
    stages = compile_stages(_xent_none, _ce_inputs(9, 100))
    (k,) = _mapreduce_steps(stages)
    assert k.tail is None and not stages.kernels[k.name].kernel.scratch


def test_sum_of_softmax_row_maxima_takes_the_same_path():
    """f32 row maxima summed over rows: the same grid reduction. In bf16 the per-row maxima are
    bf16 values and the sum a bf16 reduction, which the grid path does not take: a second kernel."""
    stages = compile_stages(_rowmax_sum, (torch.randn(37, 300),))
    (k,) = _mapreduce_steps(stages)
    assert k.tail is not None
    stages = compile_stages(_rowmax_sum, (torch.randn(37, 300).bfloat16(),))
    assert len(_mapreduce_steps(stages)) == 2


@pytest.mark.parametrize("fn", [_lse_over_rows, _softmax_over_rows], ids=["logsumexp", "softmax"])
def test_reduction_that_cannot_merge_partials_stays_apart(fn):
    """A log-sum-exp over rows (exp(v - max) of the per-row values, not the values) and a softmax
    over rows (a per-row output) are no sum/max/min of per-row values into a scalar: no grid
    reduction, and the program is still right."""
    x = torch.randn(20, 64)
    stages = compile_stages(fn, (x,))
    assert all(s.tail is None for s in _mapreduce_steps(stages))
    torch.testing.assert_close(stages.program(x), fn(x), rtol=1e-5, atol=1e-6)


CASES = [(_xent, (7, 1000)), (_xent, (333, 257)), (_xent, (2, 5)), (_xent_sum, (1025, 33)),
         (_rowmax_sum, (37, 300)), (_xent, (4097, 16))]


@pytest.mark.parametrize("fn,shape", CASES, ids=lambda v: getattr(v, "__name__", None) or f"{v[0]}x{v[1]}")
def test_interpreter_gives_what_the_two_kernels_gave(fn, shape):
    """The fused kernel's interpreter result equals, bit for bit, the row kernel then the finishing
    kernel run one after the other (each lowered from the step as planned alone)."""
    inputs = _ce_inputs(*shape) if fn is not _rowmax_sum else (torch.randn(*shape),)
    stages = compile_stages(fn, inputs)
    (step,) = _mapreduce_steps(stages)
    env = {name: to_numpy(t) for name, t in zip(stages.graph.inputs, inputs)}
    for s in stages.plan.steps:  # aliases: the inputs viewed in their shapes
        if s.family == "alias":
            n = stages.graph[s.nodes[0]]
            env[n.name] = env[n.arg].reshape(n.type.shape)
    fused = stages.kernels[step.name]
    head = lower_step(stages.graph, step.head, "head")
    tail = lower_step(stages.graph, step.tail, "tail")

    def run(lowered, env):
        k = lowered.kernel
        ins = {b.buffer: env[b.tensor].reshape(b.shape) for b in lowered.bindings if k.buffer(b.buffer).role == "in"}
        out = run_kernel(k, ins)
        return {b.tensor: out[b.buffer] for b in lowered.bindings if k.buffer(b.buffer).role == "out"}

    apart = run(tail, {**env, **run(head, env)})
    together = run(fused, env)
    assert together.keys() == apart.keys()
    for name in together:
        np.testing.assert_array_equal(together[name], apart[name])
    # and the program (CPU tensors: the interpreter) passes the 2x rule against float64
    prog = tf_compile(fn, inputs)
    out = flatten(prog(*inputs))
    ref = flatten(float64_reference(fn, inputs))
    with torch.no_grad():
        eager = flatten(fn(*inputs))
    for o, r, e in zip(out, ref, eager):
        c = compare("out", o, r, e)
        assert c.ok, c


def test_structural_hash_ignores_names_and_canonical_form_keeps_the_tail_last():
    stages = compile_stages(_xent, _ce_inputs(7, 1000))
    (step,) = _mapreduce_steps(stages)
    k = stages.kernels[step.name].kernel
    c = canon.canonicalize(k)
    verify(c)
    assert c.body[1].extent == 1 and c.body[0].extent == 7, "the grid loop stays after the row loop"
    assert canon.structural_hash(c) == canon.structural_hash(k)
    renamed = canon.canonicalize(k, rename_buffers=True)
    assert canon.structural_hash(renamed) == canon.structural_hash(k)
    assert [b.name for b in renamed.scratch] != [b.name for b in k.scratch]
    other = compile_stages(_xent_sum, _ce_inputs(7, 1000))
    (s2,) = _mapreduce_steps(other)
    assert canon.structural_hash(other.kernels[s2.name].kernel) != canon.structural_hash(k)


def test_verify_rejects_a_scratch_load_in_the_row_loop_shape_and_an_unknown_buffer():
    stages = compile_stages(_xent, _ce_inputs(7, 100))
    (step,) = _mapreduce_steps(stages)
    k = stages.kernels[step.name].kernel
    bad = ir.Kernel(k.name, k.params, k.body, k.family, k.notes, scratch=())
    with pytest.raises(ValueError, match="unknown buffer"):
        verify(bad)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("shape", [(32768, 4096), (4096, 65536), (8192, 262144), (32768, 256), (7, 4097), (1000, 300)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_cuda_source_compiles_with_a_workspace_and_resets_its_counters(shape, arch):
    stages = compile_stages(_xent, (torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape[0], dtype=torch.long)))
    (step,) = _mapreduce_steps(stages)
    kernel = stages.kernels[step.name].kernel
    src, cubin = compile_source_only(kernel, arch)
    assert cubin.info.clean, f"{shape} {arch} {src.schedule}: {cubin.info}"
    body = src.source.split('extern "C"')[1]
    assert "__device__ unsigned" not in src.source and "__device__ int" not in src.source, "no static counter"
    assert "unsigned char* __restrict__ tf_ws" in body and src.params == tuple(b.name for b in kernel.params)
    ws = workspace_layout(kernel)
    assert src.workspace_bytes == ws.nbytes > 0
    # every counter the kernel counts into is reset by the CTA that saw it full
    assert "atomicAdd(tf_cnt + tf_grp, 1u)" in body and "tf_cnt[tf_grp] = 0u;" in body
    R = shape[0]
    sch = default_schedule(kernel, arch)
    gc = -(-mapreduce.GRID_GROUP_ROWS // sch.rows_per_cta)
    ng = -(-(-(-R // sch.rows_per_cta)) // gc)
    assert f"atomicAdd(tf_cnt + {ng}, 1u)" in body and f"tf_cnt[{ng}] = 0u;" in body
    assert ng <= ws.max_groups
    # the scalar fallback (misaligned tensors) fits the same workspace
    fb = render(kernel, mapreduce.scalar_fallback(sch), arch)
    assert fb.workspace_bytes == ws.nbytes


def test_bf16_output_makes_the_fused_kernel_use_fast_math():
    """The fused kernel's only output is the bf16 scalar: mapreduce.fast_math applies (the two
    kernels apart: the row kernel's f32 outputs kept it off)."""
    stages = compile_stages(_xent, _ce_inputs(64, 4096))
    (step,) = _mapreduce_steps(stages)
    assert mapreduce.fast_math(stages.kernels[step.name].kernel)
    assert not mapreduce.fast_math(lower_step(stages.graph, step.head, "head").kernel)


GRID_LAUNCHES: list = []  # what each launch of a GridInterpKernel was handed
GRID_COMPILED = itertools.count()  # a serial number per compiled GridInterpKernel


class GridInterpKernel:
    """A 'compiled' grid-reduction kernel on CPU tensors, for the tuner's real measure path:
    the Loop IR interpreter computes the scalar, and the workspace is used as the CUDA kernel
    uses it (workspace_layout): a launch counts itself in at counter 0, and only the launch
    that finds itself the last (count 1) stores the scalar; it writes the group partials and
    resets the counter. Stream-stage schedules forget the reset, on purpose, so their second
    launch stores nothing. A launch without its workspace fails, as the CUDA kernel would."""

    def __init__(self, kernel, schedule, arch):
        self.kernel, self.schedule = kernel, schedule
        self.source = render(kernel, schedule, arch)  # source.workspace_bytes: what a launcher allocates
        self.layout = workspace_layout(kernel)
        self.serial = next(GRID_COMPILED)

    def __call__(self, *tensors, workspace=None):
        if workspace is None:
            raise ValueError("launched without its grid-reduction workspace")
        GRID_LAUNCHES.append({"kernel": self.serial, "stage": self.schedule.stage, "ptr": workspace.data_ptr(),
                              "nbytes": workspace.numel(), "dtype": workspace.dtype,
                              "zero": not bool(workspace.any())})
        counters = workspace[:4 * (self.layout.max_groups + 1)].view(torch.int32)
        counters[0] += 1
        named = dict(zip((b.name for b in self.kernel.params), tensors))
        if int(counters[0]) == 1:
            outs = run_kernel(self.kernel, {b.name: to_numpy(named[b.name]) for b in self.kernel.inputs})
            for name, a in outs.items():
                named[name].copy_(to_torch(a))
            workspace[self.layout.partials:self.layout.partials + 4] = 7  # the group's partial, left behind
        if self.schedule.stage != "stream":
            counters[0] = 0


def _grid_interp_compile(kernel, schedule, arch):
    return GridInterpKernel(kernel, schedule, arch)


def test_the_tuner_tunes_a_kernel_with_a_workspace_launched_as_the_runtime_launches_it(tmp_path):
    """A fused cross-entropy mean goes through the tuner and the real measure path (on the CPU,
    the interpreter standing in for the GPU) and is tuned. Each candidate is handed a workspace
    as the runtime's launchers provide one: uint8, of the size the rendered kernel asks for
    (the CUDA code's workspace_layout), all zeros at its first launch, kept for every launch of
    that candidate with no reset in between (a runner never clears it: the kernel resets its
    counters), and never shared with another candidate. A candidate that leaves a counter set
    fails its check (the second launch must give the first one's bits) and is not picked."""
    import sys
    from pathlib import Path

    from tilefuse.tune import device as tdevice
    from tilefuse.tune.cache import TuneCache, key_for
    from tilefuse.tune.families import register_family
    from tilefuse.tune.mapreduce import build, space
    from tilefuse.tune.measure import measure
    from tilefuse.tune.tuner import TuneOptions, Tuner

    sys.path.insert(0, str(Path(__file__).parent))
    from test_tune_tuner import InlinePool  # jobs run in this process, one at a time

    fam = register_family("grid-interp-cpu", space, build, compile_fn=_grid_interp_compile, version="test")
    stages = compile_stages(_xent, _ce_inputs(8, 40))
    (k,) = _mapreduce_steps(stages)
    kernel = replace(stages.kernels[k.name].kernel, family="grid-interp-cpu")
    assert kernel.scratch
    nbytes = workspace_layout(kernel).nbytes
    assert nbytes > 0
    GRID_LAUNCHES.clear()
    h100 = tdevice.Device("NVIDIA H100 80GB HBM3", "9.0", "13.0")
    cache = TuneCache(tmp_path / "t.sqlite")
    opts = TuneOptions(exhaustive=True, device="cpu", rep_ms=2.0, confirm_rep_ms=4.0, confirm=2, confirm_rounds=1,
                       polish=0)
    (r,) = Tuner(InlinePool(), h100, cache, opts, measure_fn=measure).tune({"k": kernel})

    assert r.status == "tuned", r.note
    assert r.knobs["stage"] != "stream" and cache.get(key_for(kernel, h100, fam)).knobs == r.knobs
    stream = [f for f in r.failures if f["knobs"]["stage"] == "stream"]
    assert stream and len(stream) == r.failed, r.failures
    assert all("differs between two launches" in f["reason"] for f in stream)
    per_kernel: dict = {}
    for launch in GRID_LAUNCHES:
        per_kernel.setdefault(launch["kernel"], []).append(launch)
    assert len(per_kernel) > r.evaluated  # every candidate, and the finalists again
    for launches in per_kernel.values():
        first, *rest = launches
        assert first["nbytes"] == nbytes and first["dtype"] == torch.uint8 and first["zero"]
        assert {x["ptr"] for x in launches} == {first["ptr"]}, "one workspace for all of a candidate's launches"
        assert not any(x["zero"] for x in rest), "no reset between launches: the runtime does none"
        if first["stage"] != "stream":
            assert len(launches) >= 3  # the two checks, then the timed repetitions on the same workspace


def _norm_rows_and_total(x, w):
    xf = x.float()
    return (xf * w.float()).bfloat16(), xf.sum(-1).sum()


def test_a_grid_reduction_takes_one_row_per_row_group():
    """A short-row kernel ending in a grid reduction: its default schedule has batch 1 (the
    short-row defaults of its head would batch two rows), it renders, the tuner's default is
    valid and no candidate batches rows; a batch named explicitly is refused, saying why."""
    from dataclasses import replace

    from tilefuse.tune import mapreduce as mrs

    stages = compile_stages(_norm_rows_and_total, (torch.randn(1000, 256).bfloat16(), torch.randn(256).bfloat16()))
    (k,) = [lk.kernel for lk in stages.kernels.values() if lk.kernel.scratch]
    assert ir.grid_parts(k) is not None
    d = default_schedule(k, "sm_90a")
    assert d.batch == 1
    assert render(k, None, "sm_90a").schedule.batch == 1
    _, cubin = compile_source_only(k, "sm_90a")
    assert cubin.info.clean
    space = mrs.space(k, "sm_90a")
    assert space.valid(space.as_dict(space.default))
    assert all(space.as_dict(c)["batch"] == 1 for c in space.admitted())
    with pytest.raises(ValueError, match="batch"):
        render(k, replace(d, stage="regs", group=min(d.group, 32), threads=128, batch=2), "sm_90a")
