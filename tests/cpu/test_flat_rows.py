"""loop/flat.py: a kernel of maps alone over short or unaligned rows walks the whole tensor as
rows of K; it computes what the row-by-row kernel computes (the interpreter against PyTorch),
and it builds for sm_90a and sm_80 with no spills."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.codegen import mapreduce
from tilefuse.loop import flat
from tilefuse.runtime.launch import compile_source_only


def _kernels(p):
    return [lw.kernel for lw in p.kernels.values()]


def _gate(x, s):
    return x * torch.sigmoid(s)


def _mul(p):
    """The program's kernel of the product (the gate's sigmoid is a kernel of its own)."""
    (k,) = [k for k in _kernels(p) if "mul" in k.name]
    return k


@pytest.fixture(autouse=True)
def _no_merged_rows(monkeypatch):
    """The flat walk alone (most of these kernels' rows would merge: test_merged_rows.py)."""
    monkeypatch.setenv("TILEFUSE_MERGED_ROWS", "0")


def test_a_gate_over_rows_of_14_walks_rows_of_1024():
    """x * sigmoid(s) over [N, C, 14, 14], s of [N, C, 1, 1]: x and the result viewed as rows of
    1024 (16-byte chunks), the gate read at each element's own row of 14."""
    x, s = torch.randn(16, 32, 14, 14), torch.randn(16, 32, 1, 1)
    p = tilefuse.compile(_gate, (x, s))
    k = _mul(p)
    assert k.body[0].extent == 98 and k.body[0].body[0].extent == 1024
    assert [b.shape for b in k.params] == [(98, 1024), (16, 32), (98, 1024)]
    assert mapreduce.default_schedule(k).vector == 4  # (f32: 16 bytes)
    assert "walked as 98 rows of 1024 of the whole (rows of 14 are short" in str(p.plan)
    torch.testing.assert_close(p(x, s), _gate(x, s))


def test_no_k_dividing_the_size_keeps_the_rows():
    x, s = torch.randn(4, 8, 14, 14), torch.randn(4, 8, 1, 1)  # 6272 elements: no K of K_CHOICES divides them
    assert _mul(tilefuse.compile(_gate, (x, s))).body[0].body[-1].extent == 14


@pytest.mark.parametrize("C", [64, 98, 256])
def test_rows_of_64_or_more_keep_their_rows(C):
    """(Aligned or not: over rows of 98 and 1001 the flat kernel measured slower, loop/flat.py.)"""
    x, s = torch.randn(1024, C), torch.randn(1024, 1)
    assert _mul(tilefuse.compile(_gate, (x, s))).body[0].body[-1].extent == C


def test_reductions_and_gathers_keep_their_rows():
    x = torch.randn(64, 14)
    p = tilefuse.compile(lambda x: torch.softmax(x, -1), (x,))
    assert all(flat.flat_rows(k) is None for k in _kernels(p))
    table, idx = torch.randn(100, 14), torch.randint(0, 100, (512,))
    p = tilefuse.compile(lambda t, i: t[i] * 2, (table, idx))
    assert all(flat.flat_rows(k) is None for k in _kernels(p))
    torch.testing.assert_close(p(table, idx), table[idx] * 2)


def test_the_switch_keeps_rows(monkeypatch):
    x, s = torch.randn(16, 32, 14, 14), torch.randn(16, 32, 1, 1)
    monkeypatch.setenv("TILEFUSE_FLAT_ROWS", "0")
    p = tilefuse.compile(_gate, (x, s))
    assert _mul(p).body[0].body[-1].extent == 14
    torch.testing.assert_close(p(x, s), _gate(x, s))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(16, 32, 14, 14), (64, 4, 8, 50), (2048, 49)])
def test_flat_kernels_build_without_spills(shape, dtype, arch):
    fn = lambda x, s, b: torch.sigmoid(x * s + b) * x  # noqa: E731
    ins = (torch.randn(shape, dtype=dtype), torch.randn(*shape[:-2], 1, 1, dtype=dtype) if len(shape) > 2
           else torch.randn(shape[0], 1, dtype=dtype), torch.randn(shape[-1], dtype=dtype))
    p = tilefuse.compile(fn, ins)
    ks = [k for k in _kernels(p) if k.body[0].body and isinstance(k.body[0].body[0], type(k.body[0])) and
          k.body[0].body[0].extent in flat.K_CHOICES]
    assert ks, str(p.plan)
    for k in ks:
        src, cubin = compile_source_only(k, arch)
        assert cubin.info.clean, f"{shape} {dtype} {arch} {src.schedule}: {cubin.info}"


@settings(max_examples=60, deadline=None)
@given(lead=st.lists(st.integers(1, 6), min_size=1, max_size=3), C=st.integers(1, 40), data=st.data(),
       op=st.sampled_from(["gate", "bias", "both", "chain"]))
def test_flat_kernels_match_pytorch(lead, C, data, op):
    """Maps with arguments broadcast along any dims (a per-row gate, a per-column bias, both, a
    chain) over [..., C]: equal to PyTorch through the interpreter, flat or not (K_CHOICES made
    small enough to take these sizes)."""
    shape = tuple(lead) + (C,)
    keep = tuple(data.draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape))))
    bshape = tuple(d if k else 1 for d, k in zip(shape, keep))
    fns = {"gate": lambda x, b: x * torch.sigmoid(b), "bias": lambda x, b: x + b[..., :1, :] if len(shape) > 1 else x + b,
           "both": lambda x, b: (x - b) * torch.tanh(b), "chain": lambda x, b: torch.relu(x * 2 + b).exp() - x}
    fn = fns[op]
    x, b = torch.randn(shape, dtype=torch.float64), torch.randn(bshape, dtype=torch.float64)
    old = flat.K_CHOICES
    flat.K_CHOICES = (16, 8)
    try:
        p = tilefuse.compile(fn, (x, b))
    finally:
        flat.K_CHOICES = old
    torch.testing.assert_close(p(x, b), fn(x, b))
