"""MMA fragments: bijections onto their tiles, matching the PTX ISA's register maps."""
import pytest

from tilefuse.layout import (
    ldmatrix_dst,
    ldmatrix_rows,
    sm80_16x8x16_a,
    sm80_16x8x16_b,
    sm80_16x8x16_c,
    sm90_64x16_a,
    sm90_64xN_c,
)
from tilefuse.layout.inttuple import idx2crd
from tilefuse.layout.mma import fragment

FRAGMENTS = [sm80_16x8x16_a(), sm80_16x8x16_b(), sm80_16x8x16_c(), sm90_64x16_a(),
             *(sm90_64xN_c(n) for n in range(8, 257, 8)),
             *(ldmatrix_dst(c, t) for c in (1, 2, 4) for t in (False, True)),
             *(ldmatrix_rows(c) for c in (1, 2, 4))]


@pytest.mark.parametrize("frag", FRAGMENTS, ids=lambda f: f.name)
def test_fragment_is_a_bijection_onto_its_tile(frag):
    rows, cols = frag.tile
    owners = frag.owner()
    assert len(owners) == frag.threads * frag.values == rows * cols
    assert set(owners) == {(r, c) for r in range(rows) for c in range(cols)}


def _lanes(n=32):
    for lane in range(n):
        yield lane, lane >> 2, lane & 3


def test_sm80_fragments_match_ptx():
    a, b, c = sm80_16x8x16_a(), sm80_16x8x16_b(), sm80_16x8x16_c()
    for lane, g, q in _lanes():
        for v in range(8):
            assert a(lane, v) == (g + 8 * ((v >> 1) & 1), 2 * q + (v & 1) + 8 * (v >> 2))
        for v in range(4):
            assert b(lane, v) == (g, 2 * q + (v & 1) + 8 * (v >> 1))  # (n, k)
            assert c(lane, v) == (g + 8 * (v >> 1), 2 * q + (v & 1))


@pytest.mark.parametrize("frag", FRAGMENTS, ids=lambda f: f.name)
def test_fragment_lookups_equal_the_layout(frag):
    """frag(t, v) answers from a table built once; it must be the layout's own answer."""
    for t in range(frag.threads):
        for v in range(frag.values):
            assert frag(t, v) == idx2crd(frag.tv(t, v), frag.tile)


def test_a_wgmma_accumulator_is_built_once_per_width():
    """Renderers ask for the same accumulator fragment many times: one object (and one table)."""
    assert sm90_64xN_c(128) is sm90_64xN_c(128)
    assert sm90_64xN_c(128) != sm90_64xN_c(256)


@pytest.mark.parametrize("n", [8, 64, 128, 256])
def test_wgmma_accumulator_matches_ptx(n):
    frag = sm90_64xN_c(n)
    assert frag.threads == 128 and frag.values == n // 2
    for t in range(128):
        warp, lane = divmod(t, 32)
        g, q = lane >> 2, lane & 3
        for v in range(n // 2):
            assert frag(t, v) == (16 * warp + g + 8 * ((v >> 1) & 1), 8 * (v >> 2) + 2 * q + (v & 1))


def test_wgmma_rejects_bad_n():
    for n in (0, 12, 264):
        with pytest.raises(ValueError):
            sm90_64xN_c(n)


def test_ldmatrix_x4_feeds_the_mma_a_fragment():
    """With thread t naming row t % 16, column 8 * (t // 16) of a 16x16 A block, matrix j of
    ldmatrix.x4 is the block's quadrant (j % 2, j // 2), and the registers it delivers are
    exactly the m16n8k16 A fragment."""
    rows = ldmatrix_rows(4)
    dst = ldmatrix_dst(4)
    a = sm80_16x8x16_a()
    for t in range(32):
        j, r = divmod(rows(t, 0)[0], 8)
        assert (8 * (j % 2) + r, 8 * (j // 2)) == (t % 16, 8 * (t // 16))
        for v in range(8):
            stacked_row, col = dst(t, v)
            j, r = divmod(stacked_row, 8)
            assert a(t, v) == (8 * (j % 2) + r, 8 * (j // 2) + col)


def test_ldmatrix_trans_transposes_each_matrix():
    plain, trans = ldmatrix_dst(2), ldmatrix_dst(2, trans=True)
    for t in range(32):
        for v in range(4):
            (r0, c0), (r1, c1) = plain(t, v), trans(t, v)
            assert r0 // 8 == r1 // 8 and (r0 % 8, c0) == (c1, r1 % 8)


def test_presets_by_name():
    assert fragment("sm90-c128").tile == (64, 128)
    assert fragment("sm80-c").tile == (16, 8)
    with pytest.raises(ValueError, match="unknown fragment"):
        fragment("sm70-c")
