"""loop/flat.py's merged rows: a kernel of maps alone whose row-level values are constant over m
neighbouring rows walks rows of m * C; it computes what the row-by-row kernel computes (the
interpreter against PyTorch), leaves the kernels it cannot merge as they were, and builds for
sm_90a and sm_80 with no spills."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from tilefuse.loop import flat
from tilefuse.runtime.launch import compile_source_only


def _only_kernel(p):
    (lw,) = p.kernels.values()
    return lw.kernel


def _rows(k):
    loop = k.body[0]
    return loop.extent, loop.body[-1].extent


def _per_channel(x, w, b):
    return torch.relu(x * w + b)


def test_a_per_channel_map_over_nchw_walks_whole_planes():
    """BatchNorm's shape of map over [N, C, H, W], w and b of [C, 1, 1]: H rows of W merged into
    one plane, x and the result viewed as [N * C, H * W], the channel read at r % C once a row."""
    x, w, b = torch.randn(8, 64, 16, 16), torch.randn(64, 1, 1), torch.randn(64, 1, 1)
    p = tilefuse.compile(_per_channel, (x, w, b))
    k = _only_kernel(p)
    assert _rows(k) == (512, 256)
    assert [b.shape for b in k.params if b.role == "out"] == [(512, 256)]
    assert "rows merged 16 at a time: 512 rows of 256" in str(p.plan)
    assert "(r % 64)" in str(k)  # (the channel of the merged row: one load a row)
    torch.testing.assert_close(p(x, w, b), _per_channel(x, w, b))


def test_merging_stops_where_a_row_level_value_changes():
    """A value along H (w of [H, 1]) changes every row of W: no two rows merge."""
    x, w = torch.randn(64, 32, 16, 96), torch.randn(16, 1)
    p = tilefuse.compile(lambda x, w: x * w, (x, w))
    assert _rows(_only_kernel(p)) == (64 * 32 * 16, 96)
    torch.testing.assert_close(p(x, w), x * w)


def test_a_value_along_the_row_keeps_the_rows():
    """A vector along W would be read at c % W per element in a merged row: the rows stay."""
    x, b = torch.randn(64, 32, 16, 96), torch.randn(96)
    p = tilefuse.compile(lambda x, b: x + b, (x, b))
    assert _rows(_only_kernel(p)) == (64 * 32 * 16, 96)


def test_a_plain_map_merges_within_the_limits():
    """x * 2 - 1 has no row-level value: rows merge as far as MERGED_MAX elements and
    MERGED_MIN_ROWS rows allow; long aligned rows are left as they are."""
    x = torch.randn(16, 24, 112, 112)
    p = tilefuse.compile(lambda x: x * 2 - 1, (x,))
    R, L = _rows(_only_kernel(p))
    assert R * L == x.numel() and L % 112 == 0 and L <= flat.MERGED_MAX and R >= flat.MERGED_MIN_ROWS
    assert L > 4096, (R, L)
    torch.testing.assert_close(p(x), x * 2 - 1)
    y = torch.randn(1024, 4096)
    assert _rows(_only_kernel(tilefuse.compile(lambda y: y * 2, (y,)))) == (1024, 4096)


def test_unaligned_rows_merge_into_whole_16_byte_chunks():
    """Rows of 1001 bf16 (2002 bytes): 8 at a time are 16016 bytes, whole 16-byte chunks."""
    x = torch.randn(4096, 1001).bfloat16()
    p = tilefuse.compile(lambda x: F.silu(x) * 3, (x,))
    assert _rows(_only_kernel(p)) == (512, 8008)
    torch.testing.assert_close(p(x), F.silu(x) * 3)


def test_aligned_rows_never_merge_into_unaligned_ones():
    """Rows of 40 f32 (160 bytes) could merge 3 at a time into 120 (480 bytes, aligned) but
    never into a length whose bytes are not whole chunks while the rows' were."""
    x, s = torch.randn(3 * 600, 3, 40), torch.randn(3 * 600, 1, 1)
    p = tilefuse.compile(lambda x, s: x * s, (x, s))
    R, L = _rows(_only_kernel(p))
    assert (L * 4) % 16 == 0 and L in (40, 120)


def test_the_switch_keeps_rows(monkeypatch):
    x, w, b = torch.randn(8, 64, 16, 16), torch.randn(64, 1, 1), torch.randn(64, 1, 1)
    monkeypatch.setenv("TILEFUSE_MERGED_ROWS", "0")
    p = tilefuse.compile(_per_channel, (x, w, b))
    assert "rows merged" not in str(p.plan)  # (rows of 16: the flat walk takes them instead)
    torch.testing.assert_close(p(x, w, b), _per_channel(x, w, b))


def test_groupnorm_apply_reads_its_statistics_in_place_and_merges():
    """GroupNorm + SiLU: the apply kernel reads the groups' statistics through a view in place
    (Step.reads) and still merges (the view's index reads only the row)."""
    gn = torch.nn.GroupNorm(8, 64)
    x = torch.randn(4, 64, 32, 32)
    fn = lambda x: F.silu(gn(x))  # noqa: E731
    with torch.no_grad():
        p = tilefuse.compile(fn, (x,))
        assert "rows merged" in str(p.plan) and "in place" in str(p.plan)
        torch.testing.assert_close(p(x), fn(x), rtol=1e-4, atol=1e-5)


def test_reductions_transposes_and_slices_keep_their_rows():
    x = torch.randn(512, 16, 16)
    for fn in (lambda x: torch.softmax(x, -1), lambda x: (x.transpose(1, 2) * 2).contiguous(),
               lambda x: x[:, :, 1:] * 2):
        p = tilefuse.compile(fn, (x,))
        assert "rows merged" not in str(p.plan), str(p.plan)
        torch.testing.assert_close(p(x), fn(x))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), c=st.integers(1, 24), h=st.integers(1, 20), w=st.integers(1, 40),
       kind=st.sampled_from(["channel", "image", "plain", "channel+image"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_merged_kernels_compute_what_pytorch_does(n, c, h, w, kind, dtype):
    """Random NCHW shapes and row-level values (per channel, per image, none, both): whatever the
    merge chose, the interpreter's result is PyTorch's."""
    x = torch.randn(n, c, h, w, dtype=dtype)
    sc = torch.randn(c, 1, 1, dtype=dtype)
    si = torch.randn(n, 1, 1, 1, dtype=dtype)
    fn = {"channel": lambda x, sc, si: x * sc, "image": lambda x, sc, si: torch.sigmoid(x + si),
          "plain": lambda x, sc, si: x * 3 - 1, "channel+image": lambda x, sc, si: x * sc + si}[kind]
    p = tilefuse.compile(fn, (x, sc, si))
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(p(x, sc, si), fn(x, sc, si), **tol)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_merged_kernels_build_without_spills(dtype, arch):
    x, w, b = torch.randn(32, 64, 56, 56, dtype=dtype), torch.randn(64, 1, 1, dtype=dtype), torch.randn(64, 1, 1, dtype=dtype)
    k = _only_kernel(tilefuse.compile(_per_channel, (x, w, b)))
    assert flat.merged_rows(k) is None  # (already merged: nothing left to merge)
    src, cubin = compile_source_only(k, arch)
    assert not (cubin.info.spill_stores or cubin.info.spill_loads), cubin.info
