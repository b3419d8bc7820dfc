"""MMA register fragments as (thread, value) -> element layouts.

A Fragment's `tv` layout maps (thread, value) to the column-major index of an element of
its tile, so `frag(t, v)` gives (row, col). This is what tells an epilogue which output
element each accumulator register holds. Conventions (as in CuTe): A tiles are (M, K),
B tiles are (N, K), C/D tiles are (M, N). Values are numbered in register order.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from .inttuple import idx2crd, to_str
from .layout import Layout, parse_layout, size


@dataclass(frozen=True)
class Fragment:
    name: str
    tv: Layout            # (thread, value) -> column-major index into `tile`
    tile: tuple[int, int]  # (rows, cols)

    @cached_property
    def threads(self) -> int:
        return size(self.tv[0])

    @cached_property
    def values(self) -> int:
        return size(self.tv[1])

    @cached_property
    def _elements(self) -> tuple[tuple[int, int], ...]:
        # Every (thread, value)'s element, evaluated once: code generators ask for them ~10^5
        # times a GEMM, and the layout algebra takes ~20 us a call (most of a render's time).
        return tuple(idx2crd(self.tv(t, v), self.tile) for t in range(self.threads) for v in range(self.values))

    def __call__(self, thread: int, value: int) -> tuple[int, int]:
        """(row, col) of register `value` of `thread`."""
        if 0 <= thread < self.threads and 0 <= value < self.values:
            return self._elements[thread * self.values + value]
        return idx2crd(self.tv(thread, value), self.tile)

    def owner(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(row, col) -> (thread, value) for every element the fragment covers."""
        return {self(t, v): (t, v) for t in range(self.threads) for v in range(self.values)}

    def __str__(self):
        return f"{self.name}: tile {to_str(self.tile)}, (thread,value) -> {self.tv}"


def _frag(name, text, tile):
    return Fragment(name, parse_layout(text), tile)


# mma.sync.m16n8k16 (f16/bf16 inputs, f32 or f16 accumulators). Lane = 4*group + quad:
# A: a[v] at row group + 8*(v>>1 & 1), col 2*quad + (v & 1) + 8*(v >> 2)
# B: b[v] at n = group, k = 2*quad + (v & 1) + 8*(v >> 1)
# C: c[v] at row group + 8*(v >> 1), col 2*quad + (v & 1)


def sm80_16x8x16_a() -> Fragment:
    return _frag("sm80 m16n8k16 A", "((4,8),(2,2,2)):((32,1),(16,8,128))", (16, 16))


def sm80_16x8x16_b() -> Fragment:
    return _frag("sm80 m16n8k16 B", "((4,8),(2,2)):((16,1),(8,64))", (8, 16))


def sm80_16x8x16_c() -> Fragment:
    return _frag("sm80 m16n8k16 C", "((4,8),(2,2)):((32,1),(16,8))", (16, 8))


# wgmma.m64nNk16: 128 threads, warp w owns rows 16w..16w+15, laid out like the mma.sync
# C fragment repeated every 8 columns: d[v] at row 16*warp + group + 8*(v>>1 & 1),
# col 8*(v >> 2) + 2*quad + (v & 1).


@lru_cache(maxsize=None)
def sm90_64xN_c(n: int) -> Fragment:
    """Accumulator of wgmma m64nNk16 (N = 8, 16, ..., 256)."""
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma N must be a multiple of 8 in [8, 256], not {n}")
    tv = Layout(((4, 8, 4), (2, 2, n // 8)), ((128, 1, 16), (64, 8, 512)))
    return Fragment(f"sm90 m64n{n}k16 C", tv, (64, n))


def sm90_64x16_a() -> Fragment:
    """A operand of wgmma m64nNk16 taken from registers (16-bit types)."""
    return _frag("sm90 m64k16 A (registers)", "((4,8,4),(2,2,2)):((128,1,16),(64,8,512))", (64, 16))


# ldmatrix / stmatrix move 8x8 matrices of 16-bit elements between shared memory and
# registers. `count` matrices (1, 2 or 4) are stacked: matrix j is rows 8j..8j+7 of an
# (8*count, 8) tile. Threads 8j..8j+7 give the row addresses of matrix j (the source
# pattern, one 16-byte row each); afterwards thread t holds, of every matrix j, the
# elements (t//4, 2*(t%4) + {0,1}) (or their transpose with .trans).


def ldmatrix_rows(count: int = 4) -> Fragment:
    """Which row (16 bytes, 8 values) each thread's address names: (thread, value) -> element."""
    _check_count(count)
    rows = 8 * count
    return Fragment(f"ldmatrix.x{count} row addresses", Layout((rows, 8), (1, rows)), (rows, 8))


def ldmatrix_dst(count: int = 4, trans: bool = False) -> Fragment:
    """Registers after ldmatrix (= registers before stmatrix): (thread, value) -> element."""
    _check_count(count)
    rows = 8 * count
    if trans:
        tv = Layout(((4, 8), (2, count)), ((2, rows), (1, 8)))
    else:
        tv = Layout(((4, 8), (2, count)), ((2 * rows, 1), (rows, 8)))
    suffix = ".trans" if trans else ""
    return Fragment(f"ldmatrix.x{count}{suffix} registers", tv, (rows, 8))


stmatrix_rows = ldmatrix_rows
stmatrix_src = ldmatrix_dst


def _check_count(count: int):
    if count not in (1, 2, 4):
        raise ValueError(f"ldmatrix/stmatrix move 1, 2 or 4 matrices, not {count}")


PRESETS = {
    "sm80-a": sm80_16x8x16_a,
    "sm80-b": sm80_16x8x16_b,
    "sm80-c": sm80_16x8x16_c,
    "sm90-a": sm90_64x16_a,
    "ldmatrix-x4": lambda: ldmatrix_dst(4),
    "ldmatrix-x4-trans": lambda: ldmatrix_dst(4, trans=True),
    "ldmatrix-rows-x4": lambda: ldmatrix_rows(4),
}


def fragment(name: str) -> Fragment:
    """A fragment by preset name: sm80-a|b|c, sm90-a, sm90-c<N> (e.g. sm90-c128),
    ldmatrix-x4, ldmatrix-x4-trans, ldmatrix-rows-x4."""
    if name in PRESETS:
        return PRESETS[name]()
    if name.startswith("sm90-c") and name[6:].isdigit():
        return sm90_64xN_c(int(name[6:]))
    raise ValueError(f"unknown fragment {name!r}; known: {', '.join(PRESETS)}, sm90-c<N>")
