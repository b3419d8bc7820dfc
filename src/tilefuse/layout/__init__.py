"""CuTe's layout algebra in Python, with its divisibility conditions checked.

    >>> from tilefuse.layout import Layout, parse, composition, complement
    >>> str(composition(parse("(6,2):(8,2)"), parse("(4,3):(3,1)")))
    '((2,2),3):((24,2),8)'
    >>> str(complement(parse("4:2"), 24))
    '(2,3):(1,8)'

The code generator takes its shared-memory layouts, swizzles, TMA/wgmma parameters and
MMA fragment maps from here (hopper, mma), and its index formulas from cgen.
See docs/layout.md.
"""
from .banks import bank, row_phase_wavefronts, wavefronts
from .cgen import c_function, c_index, c_swizzle, c_tv_coords
from .hopper import (
    GmmaDescriptor,
    GmmaLayoutType,
    TmaSwizzle,
    gmma_atom,
    gmma_descriptor,
    gmma_smem_layout,
    smem_bytes,
    swizzle_bytes,
    tma_box,
    tma_swizzle,
)
from .inttuple import (
    compatible,
    congruent,
    crd2idx,
    flatten,
    idx2crd,
    prefix_product,
    product,
    product_each,
    shape_div,
)
from .layout import (
    Layout,
    append,
    blocked_product,
    coalesce,
    complement,
    composition,
    cosize,
    depth,
    filter,
    flat,
    flat_divide,
    left_inverse,
    local_partition,
    local_tile,
    logical_divide,
    logical_product,
    make_layout,
    make_ordered_layout,
    make_tv_layout,
    modes,
    parse_layout,
    raked_product,
    rank,
    right_inverse,
    size,
    slice_and_offset,
    tile_to_shape,
    tiled_divide,
    tiled_product,
    tv_coord,
    zipped_divide,
    zipped_product,
)
from .mma import (
    Fragment,
    fragment,
    ldmatrix_dst,
    ldmatrix_rows,
    sm80_16x8x16_a,
    sm80_16x8x16_b,
    sm80_16x8x16_c,
    sm90_64x16_a,
    sm90_64xN_c,
    stmatrix_rows,
    stmatrix_src,
)
from .swizzle import ComposedLayout, Swizzle, downcast, parse, parse_swizzle, recast, upcast

__all__ = [name for name in dir() if not name.startswith("_") and name not in (
    "banks", "cgen", "hopper", "inttuple", "layout", "mma", "swizzle")]
