"""Whole programs on the GPU: generated kernels vs a float64 PyTorch reference (the 2x rule).

The reference is the program's math in float64, unrounded: a program that ends in a cast to a
narrower float (AddRMSNorm's bf16 output) keeps that output in float64 in its reference. A
reference rounded to bf16 itself is what eager's fp32 result usually rounds to exactly (error 0,
so the bound is the 1e-5 floor), and a kernel whose fp32 sum differs in the last bit rounds the
odd element the other way: one element one bf16 ulp off is about 4e-5 at 33x1000, a failure
that depends only on the random inputs: measured on an H100 at 33x1000 float32, 1 in 200 thin
calls and 1 in 200 replays failed so (eager matched the rounded reference exactly in 146 of 200),
while the replays equalled the thin path bit for bit in all 200; the CPU interpreter fails 2 in 100.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.check import compare, flatten, float64_reference
from tilefuse.runtime.graphs import enabled_by_env

pytestmark = pytest.mark.gpu


class AddRMSNorm(torch.nn.Module):
    def __init__(self, n, out_dtype=torch.bfloat16):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n))
        self.out_dtype = out_dtype  # the normalised output's dtype; float64 in the reference

    def forward(self, x, res):
        h = x + res
        return h, F.rms_norm(h, (h.shape[-1],), self.weight, 1e-6).to(self.out_dtype)


def reference(fn, inputs) -> list[torch.Tensor]:
    """The float64 reference, with a final cast to a narrower float left out (see the module doc)."""
    if getattr(fn, "out_dtype", None) is not None:
        fn = copy.deepcopy(fn)
        fn.out_dtype = torch.float64
    return flatten(float64_reference(fn, inputs))


def _softmax(x):
    return torch.softmax(x, -1)


def _xent(x, t):
    return F.cross_entropy(x, t)


def _xent_sum(x, t):
    return F.cross_entropy(x, t, reduction="sum")


def _xent_rows(x, t):
    return F.cross_entropy(x, t, reduction="none")


def _gelu_mul(x, y):
    return F.gelu(x) * y + 1.0


def _max_rows(x):
    return x.max(-1)  # (values, indices): a row reduction and an argmax extern


def _layernorm_by_hand(x):
    var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
    return (x - mean) * torch.rsqrt(var + 1e-5)


def _relu_in_place(x, y):
    h = x * y
    F.relu(h, inplace=True)  # a write into the program's own tensor: runs out of place
    return h + 1.0


def _softmax_chain(x):
    for _ in range(3):  # each pass's exps are kept on chip for the next (codegen/keep.py)
        x = torch.softmax(x * 2, -1)
    return x


def _gelu_layernorm_chain(x):
    for _ in range(2):  # each GELU is computed once and kept for the LayerNorm's later passes
        x = F.layer_norm(F.gelu(x, approximate="tanh"), (x.shape[-1],))
    return x


def _add_then_scale_x(x, y):
    h = x + y  # stored by the pass that sums its squares (codegen/keep.py Moved); the final map needs x only
    return h, x * h.float().pow(2).mean(-1, keepdim=True).to(x.dtype)


def _programs(rows, cols, dtype):
    x = lambda: torch.randn(rows, cols, device="cuda", dtype=dtype)
    t = lambda: torch.randint(0, cols, (rows,), device="cuda")
    return [
        ("rmsnorm", torch.nn.RMSNorm(cols).cuda().to(dtype), lambda: (x(),)),
        ("layernorm", torch.nn.LayerNorm(cols).cuda().to(dtype), lambda: (x(),)),
        ("add_rmsnorm", AddRMSNorm(cols).cuda().to(dtype), lambda: (x(), x())),
        ("softmax", _softmax, lambda: (x(),)),
        ("cross_entropy", _xent, lambda: (x(), t())),
        ("cross_entropy_rows", _xent_rows, lambda: (x(), t())),
        ("cross_entropy_sum", _xent_sum, lambda: (x(), t())),
        ("gelu_mul", _gelu_mul, lambda: (x(), x())),
        ("max_rows", _max_rows, lambda: (x(),)),
        ("layernorm_by_hand", _layernorm_by_hand, lambda: (x(),)),
        ("relu_in_place", _relu_in_place, lambda: (x(), x())),
        ("softmax_chain", _softmax_chain, lambda: (x(),)),
        ("gelu_layernorm_chain", _gelu_layernorm_chain, lambda: (x(),)),
        ("add_then_scale_x", _add_then_scale_x, lambda: (x(), x())),
    ]


SHAPES = [(1, 1), (3, 5), (7, 4097), (33, 1000), (256, 4096), (8, 40000)]


POOLED = 2048  # outputs smaller than this are checked on several fresh draws pooled together


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_program_matches_float64_reference(shape, dtype):
    """Each program's outputs, written over NaN-poisoned buffers, pass the 2x rule on fresh inputs,
    both on the first call (the thin launch path) and later ones (captured and replayed as a CUDA
    graph; with TILEFUSE_CUDA_GRAPHS=0 the thin path again, and no graph is made).

    The 2x rule compares two errors measured on the same inputs; on a 1x1 output each is one
    rounding, so PyTorch's can be near 0 by luck (measured on an H100: gelu_mul at 1x1 in bf16
    failed once with 0.0058 against PyTorch's 0.0018; both are single bf16 roundings of
    intermediates). Small outputs are therefore checked on `POOLED` elements' worth of fresh draws
    concatenated: the thin call and the replays each on their own pool."""
    graphs = enabled_by_env()
    draws = min(64, -(-POOLED // (shape[0] * shape[1])))
    for name, fn, make in _programs(*shape, dtype):
        prog = tilefuse.compile(fn, make())
        prog.poison = True
        assert prog.graphs is (None if graphs else False)  # None: by launches; the graph pool forces it
        for call in ("thin", "graph" if graphs else "thin again"):
            # the thin pool runs with graphs off; the graph pool's first call is the capture's
            # warm-up (thin), then `draws` replays
            prog.graphs = graphs and call == "graph"
            got = []
            for _ in range(draws + (call != "thin")):
                inputs = make()  # fresh inputs, not the ones it was compiled with
                out = flatten(prog(*inputs))
                kept = [o.clone() for o in out]  # a result still held keeps its graph slot busy
                del out
                with torch.no_grad():
                    eager = flatten(fn(*inputs))
                got.append((kept, reference(fn, inputs), eager))
            for i in range(len(got[0][0])):
                cat = [torch.cat([g[k][i].reshape(-1) for g in got]) for k in range(3)]
                c = compare(f"{name}[{i}]", *cat)
                assert c.ok, f"{name} {shape} {dtype} ({call} call, {len(got)} draw(s)): {c}"
        if graphs:
            (info,) = prog.graph_info()
            if name == "max_rows" and shape[1] == 1:  # the max of one element is the input itself: a view,
                assert not info["graphs"] and "views an input" in info["reason"], info  # so no replay
                continue
            assert info["graphs"] and info["replays"] == draws, f"{name}: {info}"
        else:
            assert prog.graph_info() == [], f"{name}: graphs ran with TILEFUSE_CUDA_GRAPHS=0"


class AddLayerNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.ln = torch.nn.LayerNorm(n)
        torch.nn.init.normal_(self.ln.weight)
        torch.nn.init.normal_(self.ln.bias)

    def forward(self, x, res):
        h = x + res
        return h, self.ln(h)


def _mixed_add_layernorm(x, r):
    h = x.float() + r
    return h, F.layer_norm(h, (h.shape[-1],))


def _check_one_call(name, fn, make, what):
    """One call of `fn` compiled (no graphs) on fresh inputs from `make`, outputs written over
    NaN-poisoned buffers: each passes the 2x rule against the float64 reference."""
    prog = tilefuse.compile(fn, make(), graphs=False)
    prog.poison = True
    inputs = make()
    out = flatten(prog(*inputs))
    with torch.no_grad():
        eager = flatten(fn(*inputs))
    for i, (o, r, e) in enumerate(zip(out, reference(fn, inputs), eager)):
        c = compare(f"{name}[{i}]", o, r, e)
        assert c.ok, f"{name} {what}: {c}"


MID_SHAPES = [(37, 520), (29, 768), (19, 1032), (13, 1536), (6, 2056), (11, 1600), (9, 2304), (7, 3072), (5, 5120), (3, 6136)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", MID_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_norms_of_mid_length_rows_match_float64_reference(shape, dtype):
    """Rows of 520-6136 columns, where the default layouts stage 2-8 rows a CTA in shared
    memory, a row per 32-128 threads (codegen/mapreduce.py _smem_schedule; in bf16 at every
    shape here), some threads holding a chunk more than others (1032, 1600, 2304, 6136 columns):
    each norm's outputs, written over NaN-poisoned buffers, pass the 2x rule on fresh inputs,
    with row counts that leave the last CTA's row slots partly empty."""
    rows, cols = shape
    x = lambda: torch.randn(rows, cols, device="cuda", dtype=dtype)
    programs = [("rmsnorm", torch.nn.RMSNorm(cols).cuda().to(dtype), lambda: (x(),)),
                ("layernorm", torch.nn.LayerNorm(cols).cuda().to(dtype), lambda: (x(),)),
                ("add_rmsnorm", AddRMSNorm(cols).cuda().to(dtype), lambda: (x(), x())),
                ("add_layernorm", AddLayerNorm(cols).cuda().to(dtype), lambda: (x(), x())),
                ("softmax", _softmax, lambda: (x(),))]
    if dtype == torch.bfloat16:  # a bf16 row and an f32 row staged side by side (their chunks differ in size)
        programs.append(("mixed_add_layernorm", _mixed_add_layernorm,
                         lambda: (x(), torch.randn(rows, cols, device="cuda"))))
    for name, fn, make in programs:
        _check_one_call(name, fn, make, f"{shape} {dtype}")


@pytest.mark.parametrize("shape", [(5, 1032), (3, 4104), (3, 16384), (2, 40000)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("other", [torch.float32, torch.float64], ids=str)
def test_rows_of_mixed_widths_match_float64_reference(shape, other):
    """A bf16 row added to an f32 or f64 row, then LayerNorm: the staged rows' chunks differ in
    size (each staging area is sized by the widest; sized by its own, the bf16 area ran into
    the next and outputs were NaN), and at 16384+ columns the default layout is whichever fits
    shared memory. Outputs over NaN-poisoned buffers, the 2x rule against float64."""
    rows, cols = shape

    def fn(x, r):
        h = x.to(r.dtype) + r
        return h, F.layer_norm(h, (cols,))
    make = lambda: (torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16),
                    torch.randn(rows, cols, device="cuda", dtype=other))
    _check_one_call("mixed", fn, make, f"{shape} bf16 + {other}")


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers (8 significant bits) at |x|: 2**(e - 8) for |x| in [2**(e-1), 2**e)."""
    _, e = torch.frexp(x.double())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_rmsnorm_cast_on_many_fresh_inputs(dtype):
    """200 calls of add+RMSNorm+cast at 33x1000 (the case of the flaky failure), each on fresh
    inputs, nearly all of them replays: every call passes the 2x rule against the unrounded float64
    reference, and with float32 inputs every bf16 element is a faithful rounding of the float64
    value (within one bf16 ulp of it: the result is right to the last bit the format can say).
    Against a bf16-rounded reference about one call in 200 fails (see the module doc)."""
    rows, cols = 33, 1000
    fn = AddRMSNorm(cols).cuda().to(dtype)
    make = lambda: (torch.randn(rows, cols, device="cuda", dtype=dtype),
                    torch.randn(rows, cols, device="cuda", dtype=dtype))
    prog = tilefuse.compile(fn, make(), graphs=True)  # one kernel: replayed only when asked
    prog.poison = True
    worst = 0.0
    for call in range(200):
        inputs = make()
        out = flatten(prog(*inputs))
        with torch.no_grad():
            eager = flatten(fn(*inputs))
        ref = reference(fn, inputs)
        for i, (o, r, e) in enumerate(zip(out, ref, eager)):
            c = compare(f"add_rmsnorm[{i}]", o, r, e)
            assert c.ok, f"call {call}, {dtype}: {c}"
        if dtype == torch.float32:
            o, r = out[1].double(), ref[1]
            off = (o - r).abs() / _bf16_ulp(torch.maximum(o.abs(), r.abs()))
            worst = max(worst, off.max().item())
            assert off.max().item() <= 1.0, f"call {call}: a bf16 element {off.max().item():.2f} ulp from float64"
    if enabled_by_env():
        (info,) = prog.graph_info()
        assert info["graphs"] and info["replays"] == 199, info


@pytest.mark.parametrize("shape", [(33, 1000), (64, 32768)], ids=str)
def test_cross_entropy_with_a_target_outside_the_classes_is_nan_on_the_gpu(shape):
    """The generated row kernels (short rows and cluster rows) make the out-of-range row's loss
    NaN, and so the mean; ignore_index rows stay 0 and the rest match eager."""
    rows, classes = shape
    x = torch.randn(rows, classes, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, classes, (rows,), device="cuda")
    t[1] = -100
    bad = t.clone()
    bad[5] = classes
    per_row = tilefuse.compile(_xent_rows, [x, t])
    got, eager = per_row(x, bad), _xent_rows(x, t)
    ref = F.cross_entropy(x.double(), t, reduction="none")
    assert torch.isnan(got[5]) and got[1] == 0
    keep = torch.ones(rows, dtype=torch.bool, device="cuda")
    keep[5] = False
    c = compare("rows", got[keep], ref[keep], eager[keep])  # the 2x rule on the rows in range
    assert c.ok, c
    mean = tilefuse.compile(_xent, [x, t])
    assert torch.isnan(mean(x, bad)) and not torch.isnan(mean(x, t))


@pytest.mark.parametrize("shape", [(64, 1000), (7, 65536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_cross_entropy_of_large_logits_keeps_the_loss_precise(shape):
    """Logits near 2048 in f32: the generated kernel computes (max - x[target]) + log(sum), so the
    per-row loss is within a few f32 ulps of the float64 one (lse - x[target] was off by the
    lse's rounding at 2048, ~1e-4)."""
    torch.manual_seed(1)
    x = torch.randn(*shape, device="cuda") + 2048
    t = torch.randint(0, shape[1], (shape[0],), device="cuda")
    fn = lambda a, b: F.cross_entropy(a, b, reduction="none")  # noqa: E731
    prog = tilefuse.compile(fn, [x, t])
    want = F.cross_entropy(x.double(), t, reduction="none")
    got = prog(x, t).double()
    assert ((got - want).abs() <= 8 * torch.finfo(torch.float32).eps * want.abs().clamp_min(1)).all(), \
        (got - want).abs().max()
