"""Maps over short rows held in registers (mapreduce._short_map_schedule): half-width chunks,
two a thread, 256 threads, 2048 threads an SM (1024 where more than 16 registers of chunks
are staged). Checked here: the layout the default picks, and that every such kernel builds for
sm_90a and sm_80 with no spill and no stack frame at the default it names."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.codegen import mapreduce as mr
from tilefuse.runtime.launch import compile_source_only


def _kernel(fn, *xs):
    p = tilefuse.compile(fn, xs)
    (lw,) = p.kernels.values()
    return lw.kernel


@pytest.mark.parametrize("shape,dtype,vector,group", [
    ((8, 1024, 32, 128), torch.bfloat16, 4, 16),   # a head permute's rows of 128: 32 chunks of 8 bytes
    ((8, 1024, 32, 64), torch.float32, 2, 16),     # rows of 64 f32: 32 chunks of 8 bytes
])
def test_a_short_map_takes_half_width_chunks_two_a_thread(shape, dtype, vector, group):
    k = _kernel(lambda x: x.transpose(1, 2).contiguous() * 2, torch.randn(shape, dtype=dtype))
    s = mr.default_schedule(k, "sm_90a")
    assert (s.stage, s.vector, s.group, s.threads, s.min_blocks) == ("regs", vector, group, 256, 8), s


def test_many_staged_streams_take_half_the_threads_an_sm():
    """Six f32 streams: 24 registers of chunks a thread, more than 32 registers leave room for."""
    xs = [torch.randn(4096, 64) for _ in range(6)]
    k = _kernel(lambda a, b, c, d, e, f: (a * b + c * d).sigmoid() * e - f, *xs)
    s = mr.default_schedule(k, "sm_90a")
    assert s.stage == "regs" and s.threads * s.min_blocks == 1024, s


CASES = {
    "one stream": (lambda a: a * 2, 1),
    "three streams": (lambda a, b, c: a * b + c, 3),
    "six streams": (lambda a, b, c, d, e, f: (a * b + c * d).sigmoid() * e - f, 6),
    "six streams, transcendental": (lambda a, b, c, d, e, f: F.gelu(a) * torch.sigmoid(b) + torch.tanh(c) * d.exp()
                                    - e.log1p().abs() * f, 6),
}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("C,dtype", [(128, torch.bfloat16), (1024, torch.bfloat16), (64, torch.float32),
                                     (256, torch.float16)], ids=str)
def test_short_map_kernels_build_clean_at_their_default(name, C, dtype, arch):
    """No spill and no stack frame at the default itself (the build lowers min_blocks where a
    default spills; here it must not need to)."""
    fn, n = CASES[name]
    p = tilefuse.compile(fn, tuple(torch.randn(4096, C, dtype=dtype) for _ in range(n)))
    for lw in p.kernels.values():
        src, cubin = compile_source_only(lw.kernel, arch)
        assert src.schedule == mr.default_schedule(lw.kernel, arch), src.schedule
        assert cubin.info.clean, f"{src.schedule}: {cubin.info}"


def _masks(a, b, c, d):
    """Gemma 2's two masks as transformers 5.17 builds them: a bool row and an i64 row each."""
    return (torch.where(a & (b == 3), 1.0, -1e30).to(torch.bfloat16),
            torch.where(c & (d == 5), 1.0, -1e30).to(torch.bfloat16))


def _wide(*xs):
    """Six i64 rows beside a bool one: past render's registers at any chunk width of a short map."""
    m = xs[0]
    for x in xs[1:]:
        m = m & (x > 0)
    return torch.where(m, 2.0, 0.0).to(torch.bfloat16)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("fn,n_i64", [(_masks, 2), (_wide, 6)], ids=["gemma2 masks", "six i64 rows"])
def test_wide_streams_beside_narrow_ones_get_a_default_that_builds(fn, n_i64, arch):
    """The chunk width follows the narrowest stream (bool: 16 a chunk), so two chunks a thread of
    the i64 rows held 72 registers, past what render accepts (MAX_STAGED_WORDS): the program
    failed to build and Gemma 2 fell back to eager (model_sweep, H200, transformers 5.17).
    Now the default holds at most MAX_STAGED_WORDS, or streams the row, and builds clean."""
    S = 2048
    if fn is _masks:
        xs = (torch.rand(4096, S) > 0.5, torch.randint(0, 8, (4096, S)),
              torch.rand(4096, S) > 0.5, torch.randint(0, 8, (4096, S)))
    else:
        xs = (torch.rand(4096, S) > 0.5,) + tuple(torch.randint(-4, 4, (4096, S)) for _ in range(n_i64))
    p = tilefuse.compile(fn, xs)
    for lw in p.kernels.values():
        s = mr.default_schedule(lw.kernel, arch)
        assert s.stage != "regs" or mr.held_words(lw.kernel, s) <= mr.MAX_STAGED_WORDS, s
        src, cubin = compile_source_only(lw.kernel, arch)
        assert src.schedule == s and cubin.info.spill_stores == 0 and cubin.info.spill_loads == 0, cubin.info
    got, want = p(*xs), fn(*xs)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)


STREAM_DTYPES = [torch.bool, torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("C", [64, 256, 1024, 2048, 4096], ids=str)
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_every_mix_of_stream_dtypes_gets_a_default_that_renders(C, arch):
    """Maps reading 1 to 6 rows of any mix of dtypes: the default schedule is one render accepts
    (the registers it holds, the chunk width, the threads), whatever the row length. A default
    render refused failed the whole program's build (Gemma 2's masks, session 73)."""
    import random

    rnd = random.Random(C)
    for trial in range(12):
        dts = [rnd.choice(STREAM_DTYPES) for _ in range(rnd.randint(1, 6))]

        def fn(*xs):
            acc = torch.zeros((), dtype=torch.float32)
            for x in xs:
                acc = acc + (x.float() if x.dtype != torch.bool else x.float() * 2)
            return acc.to(torch.bfloat16)

        xs = tuple((torch.rand(8, C) > 0.5) if d == torch.bool
                   else torch.randint(-5, 5, (8, C), dtype=d) if not d.is_floating_point
                   else torch.randn(8, C, dtype=d) for d in dts)
        p = tilefuse.compile(fn, xs)
        for lw in p.kernels.values():
            sch = mr.default_schedule(lw.kernel, arch)
            mr.render(lw.kernel, sch, arch)  # (raises where render refuses the schedule)
            assert sch.stage != "regs" or mr.held_words(lw.kernel, sch) <= mr.MAX_STAGED_WORDS, (dts, sch)
