"""F.pad's gather read as a stream (codegen/mapreduce.py `_clamped_column`): where the pad's
column is min(max(c + k, lo), hi) with k a whole number of chunks, each chunk inside the row
is one 16-byte load at c0 + k, and only the chunks at the pad's edge load element by element.
The Loop IR is unchanged (the interpreter's values are the gather's); these tests check the
column algebra against a direct evaluation, which loads the rendered kernels make, and that
every such kernel builds without spills."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.codegen import mapreduce as mr
from tilefuse.loop import ir
from tilefuse.runtime.launch import compile_source_only

OPS = ("add", "sub", "max", "min")


def _chain(steps):
    """A block's statements: i = c, then one integer op with a constant per step."""
    body, consts, v = [ir.IndexValue("i", ir.Var("c"), "i64")], {}, "i"
    for n, (op, k, const_first) in enumerate(steps):
        consts[f"k{n}"] = k
        args = (f"k{n}", v) if const_first else (v, f"k{n}")
        body.append(ir.Op(f"v{n}", op, args, "i64"))
        v = f"v{n}"
    return {s.dst: s for s in body}, consts, v


def _evaluate(steps, c):
    x = c
    for op, k, const_first in steps:
        a, b = (k, x) if const_first else (x, k)
        x = {"add": a + b, "sub": a - b, "max": max(a, b), "min": min(a, b)}[op]
    return x


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(OPS), st.integers(-20, 20), st.booleans()), max_size=6))
def test_clamped_column_equals_the_chain_it_reads_at_every_column(steps):
    """Where the algebra recognises a chain as min(max(c + k, lo), hi), that is its value at
    every column; a constant minus the column (a flip) is not recognised."""
    defs, consts, v = _chain(steps)
    got = mr._clamped_column(v, "c", defs, consts)
    negated = any(op == "sub" and first for op, _, first in steps)
    if negated:
        assert got is None
        return
    assert got is not None
    k, lo, hi = got
    for c in range(-60, 60):
        x = c + k
        x = x if lo is None else max(x, lo)
        x = x if hi is None else min(x, hi)
        assert x == _evaluate(steps, c), (steps, got, c)


def _kernel_sources(fn, x, arch="sm_90a"):
    p = tilefuse.compile(fn, (x,))
    out = []
    for lw in p.kernels.values():
        src, cubin = compile_source_only(lw.kernel, arch)
        assert cubin.info.clean, f"{arch} {src.schedule}: {cubin.info}"
        out.append(src.source)
    return p, out


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("pads,mode,dtype", [
    ((0, 96), "constant", torch.bfloat16),     # to a multiple of 128: every whole chunk inside or outside
    ((16, 8), "constant", torch.float16),      # both sides, whole chunks
    ((8, 16), "replicate", torch.bfloat16),    # the chunks outside: the edge's element, by elements
    ((-8, 24), "constant", torch.float32),     # a crop and a pad: the column starts further in
    ((4, 4), "constant", torch.float64),
], ids=str)
def test_a_pad_by_whole_chunks_reads_its_table_in_vector_loads(pads, mode, dtype, arch):
    x = torch.randn(64, 1000, dtype=dtype)
    _, srcs = _kernel_sources(lambda x: F.pad(x, pads, mode=mode) * 2, x, arch)
    (src,) = srcs
    assert "the chunk's first column in" in src, src
    # (a vector load of the chunk: 16 bytes, or 8 where a map's short rows take half-width chunks)
    assert re.search(r"tf_ld(16|8)", src.split("the chunk's first column in")[1].split("\n")[1]), src


@pytest.mark.parametrize("pads", [(1, 7), (3, 5)], ids=str)
def test_a_pad_by_part_of_a_chunk_keeps_element_loads(pads):
    """The output rows come in chunks of 8, but the chunk at c0 + k would not be 16-byte aligned:
    each element is loaded at its column."""
    x = torch.randn(64, 1000, dtype=torch.bfloat16)
    _, (src,) = _kernel_sources(lambda x: F.pad(x, pads) * 2, x)
    assert "the chunk's first column in" not in src, src


def test_a_flip_is_not_a_clamped_stream():
    x = torch.randn(64, 1024, dtype=torch.bfloat16)
    _, (src,) = _kernel_sources(lambda x: x.flip(-1) * 2, x)
    assert "the chunk's first column in" not in src


def test_a_smem_staged_kernel_loads_the_pad_in_its_pass():
    """stage="smem" copies rows with cp.async, whole 16-byte pieces; a pad's edge chunk is loaded
    by elements, so its stream is loaded where the pass reads it, and the norm's row beside it is
    staged."""
    x, y = torch.randn(64, 4096, dtype=torch.bfloat16), torch.randn(64, 4088, dtype=torch.bfloat16)
    fn = lambda x, y: F.rms_norm(x, (4096,)) + F.pad(y, (0, 8))  # noqa: E731
    p = tilefuse.compile(fn, (x, y))
    (lw,) = p.kernels.values()
    sch = mr.default_schedule(lw.kernel)
    from dataclasses import replace
    src, cubin = compile_source_only(lw.kernel, "sm_90a", replace(sch, stage="smem"))
    assert cubin.info.clean, str(cubin.info)
    assert "tf_cp_async16" in src.source and "the chunk's first column in" in src.source


# ---------------------------------------------------------------- index ranges (loop/lower.py)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 40), steps=st.lists(st.tuples(st.sampled_from(OPS), st.integers(-50, 50), st.booleans()),
                                            max_size=6))
def test_index_range_holds_every_value_of_the_index(n, steps):
    """index_range bounds every element an index computes (iota, constants, add / sub / min /
    max), so a gather at an index it puts inside the table can skip the range check."""
    import numpy as np

    from tilefuse.graph import ir as g
    from tilefuse.loop.lower import index_range

    t = lambda shape: g.TensorType(shape, "i64")  # noqa: E731
    nodes = {"i": g.Iota("i", t((n,)), 0)}
    x, v = "i", np.arange(n)
    for k, (op, c, const_first) in enumerate(steps):
        nodes[f"k{k}"] = g.Constant(f"k{k}", t(()), c)
        args = (f"k{k}", x) if const_first else (x, f"k{k}")
        nodes[f"m{k}"] = g.Map(f"m{k}", t((n,)), op, args)
        a, b = (c, v) if const_first else (v, c)
        v = {"add": a + b, "sub": a - b, "max": np.maximum(a, b), "min": np.minimum(a, b)}[op] * np.ones(n, int)
        x = f"m{k}"
    lo, hi = index_range(nodes, x)
    assert lo <= v.min() and v.max() <= hi, (steps, (lo, hi), v)


def test_a_pads_gather_has_no_range_check_and_a_token_gather_keeps_it():
    """F.pad's and flip's indices are in the table by construction: no NaN select (and no
    second clamp) per element. Token ids come from the caller: out of range gives NaN."""
    x = torch.randn(16, 64)
    for fn in (lambda x: F.pad(x, (0, 8)), lambda x: x.flip(-1)):
        p = tilefuse.compile(fn, (x,))
        (lw,) = p.kernels.values()
        assert "nan" not in str(lw.kernel), str(lw.kernel)
        assert torch.equal(p(x), fn(x))
    ids = torch.randint(0, 16, (8,))
    p = tilefuse.compile(lambda w, i: F.embedding(i, w) * 2, (x, ids))
    assert any("nan" in str(lw.kernel) for lw in p.kernels.values())
