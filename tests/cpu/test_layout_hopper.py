"""Hopper shared-memory atoms, TMA swizzle mode, wgmma descriptors, and bank conflicts."""
import pytest

from tilefuse.layout import (
    GmmaLayoutType,
    Layout,
    Swizzle,
    TmaSwizzle,
    gmma_atom,
    gmma_descriptor,
    gmma_smem_layout,
    parse,
    recast,
    row_phase_wavefronts,
    size,
    smem_bytes,
    swizzle_bytes,
    tma_box,
    tma_swizzle,
    wavefronts,
)

ALL_ATOMS = [(major, sw, bits) for major in ("K", "MN") for sw in (0, 32, 64, 128)
             for bits in (8, 16, 32)]


@pytest.mark.parametrize("major,sw,bits,expected", [
    ("K", 128, 16, "Sw<3,3,3> o (8,64):(64,1)"),
    ("K", 128, 8, "Sw<3,4,3> o (8,128):(128,1)"),
    ("K", 128, 32, "Sw<3,2,3> o (8,32):(32,1)"),
    ("K", 64, 16, "Sw<2,3,3> o (8,32):(32,1)"),
    ("K", 32, 16, "Sw<1,3,3> o (8,16):(16,1)"),
    ("K", 0, 16, "Sw<0,3,3> o (8,8):(8,1)"),
    ("MN", 128, 16, "Sw<3,3,3> o (64,8):(1,64)"),
    ("MN", 64, 8, "Sw<2,4,3> o (64,8):(1,64)"),
])
def test_gmma_atoms(major, sw, bits, expected):
    assert str(gmma_atom(major, sw, bits)) == expected


@pytest.mark.parametrize("major,sw,bits", ALL_ATOMS)
def test_atoms_are_bijections_swizzling_16_byte_chunks(major, sw, bits):
    atom = gmma_atom(major, sw, bits)
    assert sorted(atom(i) for i in range(size(atom))) == list(range(size(atom)))
    assert smem_bytes(atom, bits) == 8 * max(sw, 16)
    as_bytes = recast(atom, bits, 8)
    assert as_bytes.outer == Swizzle({0: 0, 32: 1, 64: 2, 128: 3}[sw], 4, 3)
    assert swizzle_bytes(atom, bits) == sw
    assert tma_swizzle(atom, bits) == TmaSwizzle({0: 0, 32: 1, 64: 2, 128: 3}[sw])


def test_tma_swizzle_rejects_swizzles_tma_does_not_have():
    with pytest.raises(ValueError, match="only know"):
        tma_swizzle(parse("Sw<3,3,3> o (8,32):(32,1)"), 32)  # Sw<3,5,3> on bytes
    assert tma_swizzle(Layout((64, 64), (64, 1)), 16) == TmaSwizzle.NONE


def test_tma_box_is_one_swizzle_span_wide():
    tile = gmma_smem_layout("K", 128, 16, (128, 128))
    assert tma_box(tile, "K", 16) == (64, 128)
    assert tma_box(gmma_smem_layout("MN", 64, 16, (64, 64)), "MN", 16) == (32, 64)


def test_descriptor_of_the_usual_bf16_tile():
    tile = gmma_smem_layout("K", 128, 16, (128, 64))
    desc = gmma_descriptor(tile, "K", 16)
    assert desc.layout_type == GmmaLayoutType.B128
    assert (desc.lbo, desc.sbo) == (16, 1024)
    word = desc.encode(start_address=0x400)
    assert word & 0x3FFF == 0x40
    assert (word >> 16) & 0x3FFF == 1 and (word >> 32) & 0x3FFF == 64
    assert word >> 62 == 1


def _hardware_address(major, desc, sw_bytes, bits, m, k):
    """Byte offset the wgmma unit reads for element (m, k), from the PTX canonical layouts."""
    eb = bits // 8
    if major == "K":
        if sw_bytes == 0:  # 8x16-byte core matrices: rows 16 B apart, K-neighbours at LBO
            t = 16 // eb
            pre = (m % 8) * 16 + (m // 8) * desc.sbo + (k % t) * eb + (k // t) * desc.lbo
        else:
            pre = (m % 8) * sw_bytes + (m // 8) * desc.sbo + k * eb
    else:
        if sw_bytes == 0:
            t = 16 // eb
            pre = (m % t) * eb + (m // t) * desc.sbo + (k % 8) * 16 + (k // 8) * desc.lbo
        else:
            w = sw_bytes // eb
            pre = (m % w) * eb + (m // w) * desc.lbo + (k % 8) * sw_bytes + (k // 8) * desc.sbo
    return Swizzle({0: 0, 32: 1, 64: 2, 128: 3}[sw_bytes], 4, 3)(pre)


@pytest.mark.parametrize("major,sw,bits", ALL_ATOMS)
def test_descriptor_reads_the_layouts_bytes(major, sw, bits):
    tile = gmma_smem_layout(major, sw, bits, (128, 128))
    desc = gmma_descriptor(tile, major, bits)
    assert desc.layout_type == {0: GmmaLayoutType.INTERLEAVE, 32: GmmaLayoutType.B32,
                                64: GmmaLayoutType.B64, 128: GmmaLayoutType.B128}[sw]
    eb = bits // 8
    for m in range(128):
        for k in range(32 // eb):
            assert tile(m, k) * eb == _hardware_address(major, desc, sw, bits, m, k)


@pytest.mark.parametrize("text,major", [
    ("(64,64):(64,1)", "K"),                     # plain row-major: rows are not 16 B apart
    ("Sw<3,3,3> o (64,128):(128,1)", "K"),       # SW128 atom with a 256-byte row pitch
    ("Sw<3,3,3> o (64,64):(1,64)", "K"),         # MN-major data described as K-major
])
def test_descriptor_rejects_non_canonical_layouts(text, major):
    with pytest.raises(ValueError, match="canonical"):
        gmma_descriptor(parse(text), major, 16)


# ------------------------------------------------------------------ bank conflicts


def test_sw128_atom_is_conflict_free_for_ldmatrix_rows_and_plain_rows_are_not():
    swizzled = gmma_atom("K", 128, 16)           # Sw<3,3,3> o (8,64):(64,1), bf16
    plain = Layout((8, 64), (64, 1))
    assert row_phase_wavefronts(swizzled, elem_bytes=2) == 1
    assert row_phase_wavefronts(plain, elem_bytes=2) == 8


def test_ldmatrix_x4_on_a_swizzled_tile_counts_conflicts_per_phase():
    """ldmatrix.x4 of a 16x16 bf16 A block at k0: thread t names row t % 16 at column
    k0 + 8 * (t // 16); the 32 addresses go out in 4 phases of 8 threads, 16 bytes each."""
    tile = gmma_smem_layout("K", 128, 16, (64, 64))
    plain = Layout((64, 64), (64, 1))
    for layout, expected in ((tile, 1), (plain, 8)):
        for k0 in range(0, 64, 16):
            addrs = [layout(t % 16, k0 + 8 * (t // 16)) * 2 for t in range(32)]
            phases = [addrs[8 * p: 8 * p + 8] for p in range(4)]
            assert max(wavefronts(ph, 16) for ph in phases) == expected


def test_stmatrix_of_the_accumulator_into_sw128_is_conflict_free():
    """stmatrix writes 8 rows x 16 bytes per phase too; an epilogue staging tile of
    (64, 64) bf16 in SW128 takes one wavefront per phase."""
    tile = gmma_smem_layout("K", 128, 16, (64, 64))
    assert row_phase_wavefronts(tile, 2) == 1


@pytest.mark.parametrize("sw", [32, 64, 128])
def test_narrower_swizzles_are_conflict_free_within_their_atom(sw):
    assert row_phase_wavefronts(gmma_atom("K", sw, 16), 2) == 1


def test_wavefront_counting():
    assert wavefronts([0, 4, 8, 12] * 8, 4) == 1                 # broadcast: same words
    assert wavefronts([128 * i for i in range(32)], 4) == 32    # all in bank 0
    assert wavefronts([16 * i for i in range(8)], 16) == 1      # 8 x 16 B covers 32 banks
