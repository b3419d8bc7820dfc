"""Column kernels whose rows are split between threads a warp apart (MapReduceSchedule.across),
on the GPU: every split of 2-32 threads, 32 or 64 rows a CTA, registers and streamed, against
the float64 reference under the 2x rule, outputs poisoned; row counts that leave the last CTA
part empty, row lengths the split does not divide, 16-bit and f32; batches of 2 and 4
neighbouring rows read as one vector a column (an odd row count leaves the last batch part
empty), and a misaligned input, which runs the scalar variant."""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def ln_channels_first(x):
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    return (x - u) / torch.sqrt(s + 1e-6)


CASES = {
    "softmax C 97 bf16": (lambda x: torch.softmax(x, 1), (3, 97, 40, 50), torch.bfloat16),
    "softmax C 5 f16": (lambda x: torch.softmax(x, 1), (2, 5, 77, 91), torch.float16),
    "layernorm C 96 f32": (ln_channels_first, (2, 96, 33, 65), torch.float32),
    "mean times max C 1000 bf16": (lambda x: x.mean(1) * x.amax(1), (4, 1000, 33, 7), torch.bfloat16),
    "var C 200 f32": (lambda x: x.var(1), (2, 200, 45, 31), torch.float32),
    "log_softmax dim 0 C 1000 bf16": (lambda x: torch.log_softmax(x, 0), (1000, 4099), torch.bfloat16),
}


def _schedules(C):
    from tilefuse.codegen.mapreduce import MapReduceSchedule

    for g in (2, 4, 8, 16, 32):
        for rows in (32, 64):
            if g * rows > 1024:
                continue
            yield MapReduceSchedule(threads=g * rows, group=g, vector=1, stage="stream", unroll=16, across=True)
            if math.ceil(C / g) <= 192:
                yield MapReduceSchedule(threads=g * rows, group=g, vector=1, stage="regs", across=True)
            for batch in (2, 4):
                if math.ceil(C / g) * batch <= 128:
                    yield MapReduceSchedule(threads=g * rows, group=g, vector=1, stage="regs", across=True,
                                            batch=batch)


@pytest.mark.parametrize("case", list(CASES))
def test_every_split_of_a_column_kernel_matches_the_reference(case, monkeypatch):
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.codegen import columns
    from tilefuse.runtime.launch import compile_kernel

    monkeypatch.setenv("TILEFUSE_COLUMN_MIN_ROWS", "1")
    fn, shape, dtype = CASES[case]
    torch.manual_seed(len(case))
    x = torch.randn(*shape, device="cuda", dtype=dtype) * 3
    prog = tilefuse.compile(fn, (x,))
    (lw,) = prog.kernels.values()
    k = lw.kernel
    assert columns.strided_rows(k), str(prog.plan)
    ref, eager = float64_reference(fn, (x,)), fn(x)
    C = shape[1] if "dim 0" not in case else shape[0]
    for sch in _schedules(C):
        ck = compile_kernel(k, schedule=sch)
        assert ck.info.clean, f"{sch}: {ck.info}"
        outs = ck.allocate_outputs()
        (got,) = outs.values()  # (the kernel writes one output: the program's)
        got.fill_(float("nan"))
        ck(*[x if b.role == "in" else outs[b.name] for b in k.params])
        torch.cuda.synchronize()
        c = compare(f"{case} {sch}", got.view(eager.shape), ref, eager)
        assert c.ok, c


def test_the_default_split_runs_in_the_program():
    """A program at the default row floor takes the default split (a row split between threads
    a warp apart) and matches the reference in the thin call and the graph replay."""
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.codegen import mapreduce

    torch.manual_seed(3)
    x = torch.randn(8, 200, 64, 65, device="cuda", dtype=torch.bfloat16)
    fn = lambda x: torch.softmax(x, 1)  # noqa: E731
    prog = tilefuse.compile(fn, (x,), graphs=True)
    prog.poison = True
    (lw,) = prog.kernels.values()
    s = mapreduce.default_schedule(lw.kernel)
    assert s.across and s.group > 1, s
    ref, eager = float64_reference(fn, (x,)), fn(x)
    for call in range(3):
        c = compare(f"call {call}", prog(x), ref, eager)
        assert c.ok, c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_batch_of_neighbouring_rows_read_as_vectors_needs_them_aligned(dtype):
    """The default schedule of a 16-bit column kernel reads a column's element of two
    neighbouring rows as one 4-byte vector: an input starting 2 bytes past a 4-byte boundary
    (a view at an odd offset) runs the kernel's scalar variant instead, with the same values."""
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.codegen import mapreduce

    torch.manual_seed(5)
    flat = torch.randn(1 + 8 * 96 * 32 * 64, device="cuda", dtype=dtype)
    fn = lambda x: x.mean(1) * x.amax(1)  # noqa: E731
    aligned = flat[:-1].view(8, 96, 32, 64).clone()
    prog = tilefuse.compile(fn, (aligned,))
    (lw,) = prog.kernels.values()
    s = mapreduce.default_schedule(lw.kernel)
    assert s.across and s.batch == (2 if dtype == torch.bfloat16 else 1), s
    for x in (aligned, flat[1:].view(8, 96, 32, 64)):
        assert x.data_ptr() % 4 == (2 if x is not aligned and dtype == torch.bfloat16 else 0)
        ref, eager = float64_reference(fn, (x,)), fn(x)
        c = compare(f"offset {x.storage_offset()}", prog(x), ref, eager)
        assert c.ok, c


@pytest.mark.parametrize("case", ["slice", "rows 3 apart", "row stream"])
def test_the_reviews_programs_match_the_reference(case):
    """Programs a review found a batch of rows wrong on (a slice's rows read as a misaligned
    vector, rows 3 elements apart read as neighbours, a row stream staged per batch row)."""
    import tilefuse
    from tilefuse.check import compare, float64_reference

    C, A = 64, 8
    fn, shapes = {
        "slice": (lambda x, z: (x[:, :, :32] * z).sum(0), [(64, 64, 33), (64, 64, 32)]),
        "rows 3 apart": (lambda x, z: (x[:, :, 1:17].reshape(C, A * 16)[:, 1:121].reshape(C, 60, 2) * z).sum(0),
                         [(64, 8, 18), (64, 60, 2)]),
        "row stream": (lambda x, y: (x * y[:, :, None]).sum(1), [(16, 768, 256), (16, 768)]),
    }[case]
    torch.manual_seed(7)
    ins = tuple(torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in shapes)
    import os
    os.environ["TILEFUSE_COLUMN_MIN_ROWS"] = "1"
    try:
        prog = tilefuse.compile(fn, ins)
    finally:
        del os.environ["TILEFUSE_COLUMN_MIN_ROWS"]
    prog.poison = True
    c = compare(case, prog(*ins), float64_reference(fn, ins), fn(*ins))
    assert c.ok, c
