"""Generated map-reduce kernels on the GPU vs a float64 PyTorch reference (DESIGN.md's 2x rule).

Fresh random normal inputs per case, outputs poisoned with NaN before the launch (an
unwritten element fails), odd shapes, every schedule family: sub-warp and warp rows,
multi-warp rows, clusters (sm_90), the streaming stage, and the scalar fallback for
misaligned tensors.
"""
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
import loop_fixtures as fx  # noqa: E402

from tilefuse import dtypes  # noqa: E402
from tilefuse.codegen.mapreduce import MapReduceSchedule, default_schedule  # noqa: E402
from tilefuse.loop import ir  # noqa: E402
from tilefuse.runtime.launch import compile_kernel  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [(3, 1), (5, 1000), (7, 4097), (64, 256), (33, 4096), (16, 65536), (4, 262144), (3, 300001)]


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode()) ^ int(torch.randint(0, 2**30, ()).item())


def _run(ex: fx.Example, schedule=None, misalign: bool = False) -> dict:
    """Launch the example's kernel on fresh GPU copies of its inputs; outputs as f32/f64 numpy."""
    ck = compile_kernel(ex.kernel, schedule=schedule)
    assert ck.info.clean, ck.info
    args, outs = [], {}
    for b in ex.kernel.params:
        if b.role == "in":
            t = fx.to_torch(ex.inputs[b.name]).cuda()
            if misalign:  # same values, data pointer 1 element past a 256-byte boundary
                spare = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
                spare[1:].copy_(t.reshape(-1))
                t = spare[1:].view(t.shape)
            args.append(t)
        else:
            t = torch.full(b.shape, float("nan"), dtype=dtypes.to_torch(b.dtype), device="cuda")
            outs[b.name] = t
            args.append(t)
    ck(*args)
    torch.cuda.synchronize()
    return {k: (v.float() if v.dtype in (torch.bfloat16, torch.float16) else v).cpu().numpy() for k, v in outs.items()}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("name", fx.NAMES)
def test_fixture_matches_pytorch(name, dtype, shape):
    ex = fx.example(name, *shape, dtype, seed=_seed(name, dtype, shape))
    fx.check_against_torch(ex, _run(ex))


SCHEDULES = [
    MapReduceSchedule(threads=256, group=4, vector=8),
    MapReduceSchedule(threads=256, group=32, vector=8, min_blocks=3),
    MapReduceSchedule(threads=256, group=128, vector=8, min_blocks=3),
    MapReduceSchedule(threads=256, group=256, vector=8, stage="stream", unroll=2),
    MapReduceSchedule(threads=128, group=128, vector=8, cluster=2),
    MapReduceSchedule(threads=128, group=128, vector=4, cluster=8, stage="stream"),
    MapReduceSchedule(threads=256, group=8, vector=8, stage="smem", min_blocks=4),
    MapReduceSchedule(threads=128, group=128, vector=8, stage="smem", min_blocks=12),
    MapReduceSchedule(threads=64, group=64, vector=8, cluster=4, stage="smem"),
    MapReduceSchedule(threads=512, group=512, vector=8, stage="stream", min_blocks=2, l2_hints=True),
    MapReduceSchedule(threads=256, group=256, vector=8, stage="smem", min_blocks=6, pipeline=True, l2_hints=True),
    MapReduceSchedule(threads=256, group=8, vector=8, min_blocks=3, l2_hints=True),
]


@pytest.mark.parametrize("sched", SCHEDULES, ids=str)
@pytest.mark.parametrize("name", ["rmsnorm", "softmax", "cross_entropy", "layernorm", "add_rmsnorm"])
def test_schedules_agree(name, sched):
    ex = fx.example(name, 9, 136 if sched.group <= 32 else 4000, "bf16", seed=_seed(name, str(sched)))
    fx.check_against_torch(ex, _run(ex, sched))


@pytest.mark.parametrize("name", ["softmax", "add_rmsnorm"])
def test_more_than_48k_of_shared_memory(name):
    sched = MapReduceSchedule(threads=1024, group=1024, vector=8, stage="smem")
    ex = fx.example(name, 5, 32768, "bf16", seed=_seed(name, "big smem"))
    fx.check_against_torch(ex, _run(ex, sched))


@pytest.mark.parametrize("name", ["rmsnorm", "softmax", "add_rmsnorm"])
def test_misaligned_tensors_run_the_scalar_variant(name):
    ex = fx.example(name, 6, 4096, "bf16", seed=_seed(name, "misaligned"))
    fx.check_against_torch(ex, _run(ex, misalign=True))


def test_runs_on_the_current_stream():
    ex = fx.example("softmax", 512, 4096, "bf16", seed=_seed("stream"))
    ck = compile_kernel(ex.kernel)
    x = fx.to_torch(ex.inputs["x"]).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = torch.full_like(x, float("nan"))
        ck(x, y)
    s.synchronize()
    assert torch.allclose(y.float(), torch.softmax(x.float(), -1), atol=1e-2)


def test_nan_inputs_propagate():
    ex = fx.example("softmax", 4, 4096, "bf16", seed=1)
    x = fx.to_torch(ex.inputs["x"]).cuda()
    x[2, 17] = float("nan")
    y = torch.zeros_like(x)
    compile_kernel(ex.kernel)(x, y)
    torch.cuda.synchronize()
    assert torch.isnan(y[2]).all() and not torch.isnan(y[[0, 1, 3]]).any()


def test_default_schedules_for_the_issue_shapes_cluster_on_hopper():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need sm_90")
    k = fx.softmax_kernel(8192, 262144, "bf16")
    assert default_schedule(k, "sm_90a").cluster > 1


# ---------------------------------------------------------------- online log-sum-exp and target select


def _launch(kernel, inputs: dict, schedule=None) -> dict:
    ck = compile_kernel(kernel, schedule=schedule)
    outs = ck.allocate_outputs()
    ck(*[inputs[b.name] if b.role == "in" else outs[b.name] for b in kernel.params])
    torch.cuda.synchronize()
    return outs


LONG_SCHEDULES = [None,  # the defaults: 128 x 8 (rmsnorm), 512 x 2 (LayerNorm), one CTA of 512 (softmax, loss)
                  MapReduceSchedule(threads=256, group=256, vector=8, cluster=8, stage="smem", min_blocks=6, pipeline=True),
                  MapReduceSchedule(threads=512, group=512, vector=8, cluster=2, stage="smem", min_blocks=3, pipeline=True)]


@pytest.mark.parametrize("sched", LONG_SCHEDULES, ids=str)
@pytest.mark.parametrize("name", ["softmax", "cross_entropy", "layernorm", "rmsnorm"])
def test_long_rows_on_cluster_shapes(name, sched):
    ex = fx.example(name, 5, 65536, "bf16", seed=_seed(name, str(sched), "long"))
    fx.check_against_torch(ex, _run(ex, sched))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("shape", [(6, 4096), (6, 65536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_online_softmax_keeps_special_values(dtype, shape):
    """Rows with -inf chunks (first, so the running max starts at -inf), a row of -inf
    (NaN, as exp(-inf - -inf) is), a NaN (its row NaN), a +inf, and logits near 600 (f32:
    the 2x rule on a row whose max is large)."""
    R, C = shape
    tdt = dtypes.to_torch(dtype)
    x = torch.randn(R, C, device="cuda").to(tdt) * 3
    x[0, :512] = float("-inf")
    x[1] = float("-inf")
    x[2, C // 3] = float("nan")
    x[3, 5] = float("inf")
    x[5] = x[5] * 30 + 600
    y = _launch(fx.softmax_kernel(R, C, dtype), {"x": x})["y"]
    ref = torch.softmax(x.double(), -1)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)), "NaN exactly where PyTorch has it"
    ok = ~torch.isnan(ref).any(-1)
    lowp = torch.softmax(x, -1).double()
    err = (y.double() - ref)[ok].abs().max().item()
    torch_err = (lowp - ref)[ok].abs().max().item()
    assert err <= 2 * torch_err + 1e-6, (err, torch_err)


def test_cross_entropy_target_outside_the_row_selects_nothing():
    """loss = logsumexp(x) - x[t] for 0 <= t < C, and logsumexp(x) for any other t (the
    sum of where(c == t, x, 0) is 0): -100, C, -1 and a huge index."""
    R, C = 8, 8192
    x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16) * 3
    t = torch.tensor([0, C - 1, 17, -100, C, -1, 2**40, 4095], device="cuda")
    loss = _launch(fx.cross_entropy_kernel(R, C, "bf16"), {"x": x, "target": t})["loss"]
    lse = torch.logsumexp(x.double(), -1)
    inside = (t >= 0) & (t < C)
    picked = torch.where(inside, x.double().gather(1, t.clamp(0, C - 1)[:, None])[:, 0], torch.zeros_like(lse))
    assert torch.allclose(loss.double(), lse - picked, rtol=0, atol=1e-5 * lse.abs().max().item())


# ---------------------------------------------------------------- a batch of rows per row group

BATCH_SHAPES = [(37, 256), (5, 136), (9, 1000), (130, 64)]


def _batched(kernel, batch: int) -> MapReduceSchedule | None:
    """The kernel's default chunk width, at most 4 chunks per thread (fewer where the batch's
    rows would not fit the staged registers) in a row group of at most a warp, 64 threads (so
    R is not a multiple of the CTA's rows), `batch` rows per group; None where no such group
    can hold the batch or the kernel ends in a grid reduction (one row per group)."""
    from tilefuse.codegen import mapreduce as mr

    v = default_schedule(kernel).vector
    chunks = -(-ir.row_kernel_parts(kernel).col_extent // v)
    words = max(1, mr.staged_words(kernel, v))
    per = min(4, mr.MAX_STAGED_WORDS // (words * batch))
    g = 1 << max(0, (-(-chunks // max(1, per)) - 1).bit_length())
    if per < 1 or g > 32 or ir.grid_parts(kernel) is not None:
        return None
    return MapReduceSchedule(threads=max(64, g), group=g, vector=v, batch=batch)


@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("shape", BATCH_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("name", fx.NAMES)
def test_batched_rows_match_pytorch(name, dtype, shape, batch):
    """Every fixture with a batch of 2 or 4 rows per row group (all of a thread's rows loaded
    before the first is reduced) matches PyTorch under the 2x rule, with the last CTA's rows
    partly past the end (guarded) and masked chunk tails."""
    ex = fx.example(name, *shape, dtype, seed=_seed("batch", name, dtype, shape, batch))
    sched = _batched(ex.kernel, batch)
    if sched is None:
        pytest.skip("no row group of at most a warp holds this batch in registers")
    fx.check_against_torch(ex, _run(ex, sched))


# ---------------------------------------------------------------- LayerNorm: one (count, mean, M2) pass

LAYERNORM_CASES = [
    ((9, 65536), None),  # the default: a cluster of 128-thread CTAs, every thread full
    ((9, 65536), MapReduceSchedule(threads=512, group=512, vector=8, cluster=2, stage="smem", min_blocks=3, pipeline=True)),
    ((9, 4000), MapReduceSchedule(threads=128, group=128, vector=8, cluster=2)),  # registers, cluster, masked chunks
    ((9, 4000), MapReduceSchedule(threads=128, group=128, vector=8, stage="smem", min_blocks=12)),  # masked, no cluster
    ((9, 4096), None),   # one CTA per row, staged, full
    ((9, 4097), None),   # odd row: scalar chunks, masked
    ((9, 1000), MapReduceSchedule(threads=256, group=32, vector=8, min_blocks=3)),  # a warp per row, masked
    ((9, 1000), MapReduceSchedule(threads=256, group=32, vector=8, min_blocks=3, two_pass=True)),  # two passes
    ((9, 136), MapReduceSchedule(threads=256, group=4, vector=8)),  # a sub-warp per row, masked
    ((9, 136), MapReduceSchedule(threads=256, group=4, vector=8, two_pass=True)),
    ((9, 256), None),    # short rows in registers, full
    ((9, 256), MapReduceSchedule(threads=256, group=8, vector=8, min_blocks=3, two_pass=True)),
    ((9, 256), MapReduceSchedule(threads=128, group=16, vector=8, stage="smem", min_blocks=8, two_pass=True)),  # staged
    ((9, 136), MapReduceSchedule(threads=64, group=8, vector=8, batch=2)),  # a batch of rows per row group, masked
    ((9, 1000), MapReduceSchedule(threads=64, group=32, vector=8, batch=2, two_pass=True)),
    ((9, 4000), MapReduceSchedule(threads=256, group=256, vector=8, stage="stream", unroll=2)),
    ((6, 300001), None),  # a long odd row
]


def _adversarial_layernorm(R: int, C: int, dtype: str, seed: int) -> fx.Example:
    """The LayerNorm fixture with hard rows first: 1e4 + N(0, 1) (far from 0: E[x^2] - E[x]^2
    cancels), a normal row with a 1e4 outlier, both (an outlier of -3e4), a constant row
    (variance 0), -7777.7 + N(0, 0.01^2); the other rows N(0.5, 1)."""
    import numpy as np

    ex = fx.example("layernorm", R, C, dtype, seed=seed)
    rng = np.random.default_rng(seed + 1)
    x = ex.inputs["x"].astype(np.float32)
    x[0] = 1e4 + rng.standard_normal(C)
    x[1] = rng.standard_normal(C)
    x[1, C // 3] = 1e4
    x[2] = 1e4 + rng.standard_normal(C)
    x[2, 5] = -3e4
    x[3] = 3.0
    x[4] = -7777.7 + 0.01 * rng.standard_normal(C)
    return fx.Example(ex.name, ex.kernel, {**ex.inputs, "x": x.astype(ex.inputs["x"].dtype)}, ex.reference)


def _check_rows(ex: fx.Example, ours: dict, floor: float = 1e-6) -> None:
    """DESIGN.md's 2x rule on every row by itself (an easy row is not let off by a hard one's error)."""
    import numpy as np

    lowp, ref = fx.torch_outputs(ex)
    for name, r in ref.items():
        got = fx.to_f64(ours[name])
        assert not np.isnan(got).any(), f"{name}: NaN (unwritten or wrong)"
        for i in range(r.shape[0]):
            err = float(np.max(np.abs(got[i] - r[i])))
            torch_err = float(np.max(np.abs(lowp[name][i] - r[i])))
            bound = 2 * torch_err + floor * max(1.0, float(np.max(np.abs(r[i]))))
            assert err <= bound, f"{name} row {i}: error {err:.3g} vs PyTorch's own {torch_err:.3g}"


@pytest.mark.parametrize("shape,sched", LAYERNORM_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_layernorm_one_pass_variance_on_adversarial_rows(dtype, shape, sched):
    """LayerNorm's mean and variance from one pass and one (count, mean, M2) exchange (or,
    where a warp or less holds the row, the two-pass form), row by row within 2x PyTorch's
    own error against float64, on rows far from 0, with outliers, constant, and on every
    schedule family (clusters, CTAs, warps, sub-warps, streams, masked tails, scalar chunks)."""
    ex = _adversarial_layernorm(*shape, dtype, seed=_seed("ln-adversarial", dtype, shape, str(sched)))
    _check_rows(ex, _run(ex, sched))


# ---------------------------------------------------------------- grid reductions (one kernel, one scalar)

GRID_SHAPES = [(7, 4097), (1000, 300), (4097, 512), (257, 4096), (33, 65536), (8, 262144), (32768, 256)]


def _grid_case(fn, n, c, dtype=torch.bfloat16):
    def make():
        x = torch.randn(n, c, device="cuda", dtype=dtype)
        t = torch.randint(0, c, (n,), device="cuda")
        t[torch.rand(n, device="cuda") < 0.1] = -100  # ignored rows: the mean divides by the others
        return x, t
    return make


def _counters(prog, kernel):
    """The grid reduction's arrival counters in the program's workspace (one runner per device)."""
    from tilefuse.codegen.mapreduce import workspace_layout

    (op,) = [o for o in prog.runner(torch.device("cuda", torch.cuda.current_device())).ops
             if getattr(o, "workspace", None) is not None]
    return op.workspace[:4 * (workspace_layout(kernel).max_groups + 1)].view(torch.int32)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", GRID_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_grid_reduced_cross_entropy_on_fresh_inputs_calls_and_graph_replays(shape, reduction, monkeypatch):
    """The fused cross-entropy (one kernel: row losses, then the mean over rows by the last CTA)
    passes the 2x rule against float64 on 24 fresh draws pooled (the first call thin, the rest
    CUDA-graph replays); after every launch its counters are back to 0; the same inputs give the
    same bits every time (the partials are summed in a fixed order whichever CTA finishes last)."""
    import torch.nn.functional as F

    import tilefuse
    from tilefuse.check import compare, float64_reference

    monkeypatch.setenv("TILEFUSE_GRID_REDUCE", "1")  # opt-in (graph/fusion.py)
    fn = lambda x, t: F.cross_entropy(x, t, reduction=reduction)  # noqa: E731
    make = _grid_case(fn, *shape)
    prog = tilefuse.compile(fn, make(), graphs=True)
    prog.poison = True
    (step,) = [s for s in prog.plan.steps if s.family == "mapreduce"]
    assert step.tail is not None, prog.plan
    kernel = prog.kernels[step.name].kernel
    got, refs, eager = [], [], []
    for _ in range(24):
        inputs = make()
        out = prog(*inputs).clone()
        torch.cuda.synchronize()
        assert int(_counters(prog, kernel).abs().sum()) == 0, "a counter was left non-zero"
        got.append(out.reshape(1))
        refs.append(float64_reference(fn, inputs).reshape(1))
        with torch.no_grad():
            eager.append(fn(*inputs).reshape(1))
    c = compare("loss", torch.cat(got), torch.cat(refs), torch.cat(eager))
    assert c.ok, f"{shape} {reduction}: {c}"
    (info,) = prog.graph_info()
    assert info["graphs"] and info["replays"] >= 20, info
    inputs = make()
    first = prog(*inputs).clone()
    for _ in range(10):
        assert torch.equal(prog(*inputs), first), "the grid reduction is not deterministic"


@pytest.mark.parametrize("shape", [(7, 4097), (3000, 1000), (16, 65536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_grid_reduced_kernel_alone_and_its_scalar_fallback(shape, monkeypatch):
    """The compiled kernel called directly (its own workspace) and its scalar variant (the launch
    path for misaligned tensors) give the same loss as the float64 reference within the 2x rule,
    50 launches in a row on the same workspace, counters at 0 after each."""
    import torch.nn.functional as F

    from tilefuse.check import compare, float64_reference
    from tilefuse.compiler import compile_stages

    monkeypatch.setenv("TILEFUSE_GRID_REDUCE", "1")  # opt-in (graph/fusion.py)
    fn = lambda x, t: F.cross_entropy(x, t)  # noqa: E731
    make = _grid_case(fn, *shape)
    stages = compile_stages(fn, make())
    (step,) = [s for s in stages.plan.steps if s.family == "mapreduce"]
    lowered = stages.kernels[step.name]
    ck = compile_kernel(lowered.kernel)
    assert ck.info.clean, ck.info
    dev = torch.cuda.current_device()
    from tilefuse.codegen.mapreduce import workspace_layout
    from tilefuse.runtime.runner import alias_root

    ncount = workspace_layout(lowered.kernel).max_groups + 1
    for variant in (ck, ck.scalar_variant()):
        got, refs, eager = [], [], []
        for _ in range(25):
            x, t = make()
            given = dict(zip(stages.graph.inputs, (x, t)))
            args = []
            for b in lowered.bindings:
                buf = lowered.kernel.buffer(b.buffer)
                if buf.role == "in":
                    args.append(given[alias_root(stages.plan, b.tensor)].reshape(b.shape))
                else:
                    out = torch.full(b.shape, float("nan"), dtype=dtypes.to_torch(buf.dtype), device="cuda")
                    args.append(out)
            variant.launch(args, dev)
            torch.cuda.synchronize()
            assert int(variant.workspace(dev)[:4 * ncount].view(torch.int32).abs().sum()) == 0
            got.append(out.reshape(1).float())
            refs.append(float64_reference(fn, (x, t)).reshape(1))
            with torch.no_grad():
                eager.append(fn(x, t).reshape(1))
        c = compare("loss", torch.cat(got), torch.cat(refs), torch.cat(eager))
        assert c.ok, f"{shape} {variant.schedule}: {c}"


@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "scalar"])
@pytest.mark.parametrize("cols", [256, 4096, 65536])
@pytest.mark.parametrize("name", fx.NAMES)
def test_one_build_serves_every_row_count(name, cols, misalign):
    """A source taking its row count as an argument (codegen.mapreduce.rows_free), built at one
    count, runs right at others under the same schedule, tails of a CTA's rows included: the
    launch passes each kernel's own count and grid."""
    sched = compile_kernel(fx.BUILDERS[name](1000, cols, "bf16")).schedule  # (as a build settles it)
    sources = set()
    for rows in (1000, 999, 37, 2):
        ex = fx.example(name, rows, cols, "bf16", seed=_seed(name, rows, cols))
        fx.check_against_torch(ex, _run(ex, sched, misalign))
        ck = compile_kernel(ex.kernel, schedule=sched)
        assert ck.source.rows == rows
        sources.add(ck.source.source)
    assert len(sources) == 1


def _rope(q, cos, sin):
    half = q.shape[-1] // 2
    return q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rope_tables_one_build_serves_every_prompt_length(dtype):
    """The kernel reading RoPE's cos / sin tables at the row modulo the prompt length (its rows'
    period, codegen.mapreduce.rows_period) runs right at every length with one source: each
    launch passes its own count and period (outputs poisoned, both program paths: the direct
    launch, then the CUDA-graph replay; DESIGN.md's 2x rule against float64)."""
    import tilefuse
    from tilefuse.check import compare, float64_reference

    names = set()
    for S in (300, 299, 37, 2, 1):
        x = (torch.randn(1, 5, S, 64, device="cuda", dtype=dtype), torch.randn(1, 1, S, 64, device="cuda", dtype=dtype),
             torch.randn(1, 1, S, 64, device="cuda", dtype=dtype))
        prog = tilefuse.compile(_rope, x, graphs=True)
        prog.poison = True
        ref, eager = float64_reference(_rope, x), _rope(*x)
        for _ in range(3):
            c = compare(f"rope S={S}", prog(*x), ref, eager)
            assert c.ok, c
        periodic = [k for k in prog._compiled.values() if getattr(getattr(k, "source", None), "period", None)]
        if S == 1:  # (one row of the table: no period)
            assert not periodic
            continue
        (ck,) = periodic
        assert (ck.source.period, ck.source.rows) == (S, 5 * S)
        names.add(ck.source.name)
    assert len(names) == 1
