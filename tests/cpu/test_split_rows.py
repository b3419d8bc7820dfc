"""loop/flat.py's split rows: a kernel of maps alone over few long rows (a 1-D tensor is one row)
cuts each row into pieces of K, so its CTAs are many (a map over 16M elements ran in one CTA).
The split kernel computes what PyTorch does (the interpreter), row-level values stay per row,
kernels it cannot split keep their rows, and it builds for sm_90a and sm_80 with no spills."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.runtime.launch import compile_source_only


def _only_kernel(p):
    (lw,) = p.kernels.values()
    return lw.kernel


def _rows(k):
    loop = k.body[0]
    return loop.extent, loop.body[-1].extent


def test_a_map_over_a_1d_tensor_splits_into_rows_of_1024():
    x = torch.randn(1 << 20)
    fn = lambda x: torch.expm1(x * 2 + 1).half()  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    k = _only_kernel(p)
    assert _rows(k) == (1024, 1024)
    assert "rows split: 1024 rows of 1024 (1 rows of 1048576 are few)" in str(p.plan), str(p.plan)
    torch.testing.assert_close(p(x), fn(x))


def test_a_per_row_value_stays_per_row_in_the_pieces():
    """x of [4, 100000] times s of [4, 1]: the pieces of row r read s[r] (r' // P); 100000 is
    no multiple of 1024, so K is the largest aligned divisor up to 4096 (4000)."""
    x, s = torch.randn(4, 100_000), torch.randn(4, 1)
    p = tilefuse.compile(lambda x, s: torch.sigmoid(x * s), (x, s))
    assert _rows(_only_kernel(p)) == (100, 4000)
    torch.testing.assert_close(p(x, s), torch.sigmoid(x * s))


def test_a_vector_along_the_row_is_read_at_its_piece_and_column():
    x, b = torch.randn(3, 65536), torch.randn(65536)
    p = tilefuse.compile(lambda x, b: x + b, (x, b))
    assert _rows(_only_kernel(p)) == (192, 1024)
    torch.testing.assert_close(p(x, b), x + b)


def test_what_cannot_split_keeps_its_rows():
    """Many rows (512 or more: CTAs enough), short rows, a row with no divisor in [256, 4096]
    (a prime length), and a reduction."""
    for shape, fn in (((512, 16384), lambda x: x * 2), ((4, 8192), lambda x: x * 2),
                      ((1_000_003,), lambda x: x * 2), ((2, 65536), lambda x: torch.softmax(x, -1))):
        x = torch.randn(*shape)
        p = tilefuse.compile(fn, (x,))
        assert "rows split" not in str(p.plan), (shape, str(p.plan))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), pieces=st.integers(4, 8), k=st.sampled_from([256, 512, 1000, 1024]),
       kind=st.sampled_from(["plain", "row", "col"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_split_kernels_compute_what_pytorch_does(rows, pieces, k, kind, dtype):
    C = pieces * k * 16  # (16384 and more: rows shorter keep their CTA)
    x = torch.randn(rows, C, dtype=dtype)
    s = torch.randn(rows, 1, dtype=dtype)
    v = torch.randn(C, dtype=dtype)
    fn = {"plain": lambda x, s, v: x * 3 - 1, "row": lambda x, s, v: torch.tanh(x * s),
          "col": lambda x, s, v: x * v + s}[kind]
    p = tilefuse.compile(fn, (x, s, v))
    assert "rows split" in str(p.plan), str(p.plan)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(p(x, s, v), fn(x, s, v), **tol)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_split_kernels_build_without_spills(dtype, arch):
    x, s = torch.randn(2, 1 << 20, dtype=dtype), torch.randn(2, 1, dtype=dtype)
    k = _only_kernel(tilefuse.compile(lambda x, s: torch.sigmoid(x * s), (x, s)))
    assert _rows(k) == (2048, 1024)
    src, cubin = compile_source_only(k, arch)
    assert not (cubin.info.spill_stores or cubin.info.spill_loads), cubin.info


def test_a_row_with_no_aligned_piece_splits_into_its_largest_divisor():
    """2 x 499999 (31 x 127 x 127): no divisor in [256, 4096] is whole 16-byte chunks, so the
    pieces are the largest divisor, 3937, read in narrower chunks (many CTAs beat two)."""
    x = torch.randn(2, 499_999)
    p = tilefuse.compile(lambda x: x * 2, (x,))
    assert _rows(_only_kernel(p)) == (254, 3937), str(p.plan)
    torch.testing.assert_close(p(x), x * 2)
