"""Pictures of layouts: which index (and bank) each (row, col) lands in, and which thread
owns it. SVG is written as text (no dependencies); PNG needs matplotlib; --text prints a
table. `main` is the `tilefuse layout` command.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from html import escape

from .banks import BANKS, bank, row_phase_wavefronts
from .inttuple import product_each
from .layout import Layout, size
from .mma import PRESETS, Fragment, fragment
from .swizzle import ComposedLayout, parse, parse_swizzle


@dataclass(frozen=True)
class Cell:
    row: int
    col: int
    index: int
    bank: int
    owner: tuple[int, int] | None  # (thread, value)


def grid_shape(layout) -> tuple[int, int]:
    """(rows, cols) of the picture: rank-1 layouts are one row."""
    shape = product_each(layout.shape)
    if isinstance(shape, int):
        return 1, shape
    if len(shape) == 1:
        return 1, shape[0]
    if len(shape) != 2:
        raise ValueError(f"can only draw rank-1 or rank-2 layouts; {layout} has rank {len(shape)} "
                         f"(group modes first, e.g. ((a,b),c))")
    return shape


def cells(layout, tv=None, elem_bytes: int = 2) -> list[list[Cell]]:
    """The grid of cells; `tv` (a Fragment or a (thread, value) -> index Layout over the
    grid, column-major) fills in each cell's owner."""
    rows, cols = grid_shape(layout)
    owners = {}
    if tv is not None:
        tv_layout = tv.tv if isinstance(tv, Fragment) else tv
        if isinstance(tv, Fragment) and tuple(tv.tile) != (rows, cols):
            raise ValueError(f"{tv.name} covers a {tv.tile[0]}x{tv.tile[1]} tile, "
                             f"but the layout is {rows}x{cols}")
        for t in range(size(tv_layout[0])):
            for v in range(size(tv_layout[1])):
                i = tv_layout(t, v)
                if i >= rows * cols:
                    raise ValueError(f"tv layout {tv_layout} sends (thread {t}, value {v}) to "
                                     f"{i}, outside the {rows}x{cols} grid")
                owners.setdefault((i % rows, i // rows), (t, v))
    rank1 = _rank(layout) == 1

    def at(r, c):
        return layout(c) if rank1 else layout(r, c)

    return [[Cell(r, c, at(r, c), bank(at(r, c) * elem_bytes), owners.get((r, c)))
             for c in range(cols)] for r in range(rows)]


def _rank(layout) -> int:
    shape = layout.shape
    return len(shape) if isinstance(shape, tuple) else 1


def _label(cell: Cell, label: str) -> str:
    if label == "bank":
        return str(cell.bank)
    if label == "tv":
        return "" if cell.owner is None else f"T{cell.owner[0]}V{cell.owner[1]}"
    return str(cell.index)


# ------------------------------------------------------------------ text


def render_text(layout, tv=None, label: str | None = None, elem_bytes: int = 2) -> str:
    """The grid as an aligned table, row and column numbers at the edges."""
    label = label or ("tv" if tv is not None else "index")
    grid = cells(layout, tv, elem_bytes)
    texts = [[_label(c, label) for c in row] for row in grid]
    ncols = len(grid[0])
    width = max([len(t) for row in texts for t in row] + [len(str(ncols - 1))])
    rw = len(str(len(grid) - 1))
    lines = [" " * (rw + 4) + " ".join(str(c).rjust(width) for c in range(ncols)),
             " " * (rw + 2) + "+" + "-" * ((width + 1) * ncols)]
    for r, row in enumerate(texts):
        lines.append(f"{str(r).rjust(rw)}  | " + " ".join(t.rjust(width) for t in row))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ colour


def _hsl(h: float, s: float, l: float) -> str:  # noqa: E741
    return f"hsl({h:.0f},{s:.0f}%,{l:.0f}%)"


def colour(cell: Cell, by: str) -> str:
    if by == "bank":
        return _hsl(cell.bank * 360 / BANKS, 70, 72 if cell.bank % 2 else 84)
    if by == "thread":
        if cell.owner is None:
            return "#ffffff"
        t = cell.owner[0]
        return _hsl((t * 137.508) % 360, 65, 70 + 10 * ((t // 32) % 2))
    return "#ffffff"


# ------------------------------------------------------------------ svg


def render_svg(layout, tv=None, color: str | None = None, label: str | None = None,
               elem_bytes: int = 2, title: str | None = None) -> str:
    """SVG text: one rectangle per cell, labelled and coloured by bank or by thread."""
    color = color or ("thread" if tv is not None else "bank")
    label = label or ("tv" if tv is not None else "index")
    grid = cells(layout, tv, elem_bytes)
    rows, cols = len(grid), len(grid[0])
    cw, ch, left, top = 46, 30, 34, 52
    width, height = left + cols * cw + 10, top + rows * ch + 10
    title = title or str(layout)
    legend = {"bank": f"colour: shared-memory bank ({elem_bytes}-byte elements)",
              "thread": "colour: owning thread", "none": ""}[color]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="monospace">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13">{escape(title)}</text>',
           f'<text x="{left}" y="34" font-size="10" fill="#555">{escape(legend)}</text>']
    for c in range(cols):
        out.append(f'<text x="{left + c * cw + cw / 2:.0f}" y="{top - 4}" font-size="9" '
                   f'text-anchor="middle" fill="#777">{c}</text>')
    for r in range(rows):
        out.append(f'<text x="{left - 4}" y="{top + r * ch + ch / 2 + 3:.0f}" font-size="9" '
                   f'text-anchor="end" fill="#777">{r}</text>')
    for row in grid:
        for cell in row:
            x, y = left + cell.col * cw, top + cell.row * ch
            out.append(f'<rect x="{x}" y="{y}" width="{cw}" height="{ch}" '
                       f'fill="{colour(cell, color)}" stroke="#333" stroke-width="0.5"/>')
            main_text = _label(cell, label)
            sub = f"b{cell.bank}" if color == "bank" and label != "bank" else (
                str(cell.index) if label == "tv" else "")
            out.append(f'<text x="{x + cw / 2:.0f}" y="{y + 13}" font-size="10" '
                       f'text-anchor="middle">{escape(main_text)}</text>')
            if sub:
                out.append(f'<text x="{x + cw / 2:.0f}" y="{y + 25}" font-size="8" '
                           f'text-anchor="middle" fill="#444">{escape(sub)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ png


def save_png(path: str, layout, tv=None, color: str | None = None, label: str | None = None,
             elem_bytes: int = 2, title: str | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError:
        raise RuntimeError("PNG output needs matplotlib (pip install 'tilefuse[draw]'); "
                           "write an .svg instead, which needs nothing") from None
    import colorsys

    color = color or ("thread" if tv is not None else "bank")
    label = label or ("tv" if tv is not None else "index")
    grid = cells(layout, tv, elem_bytes)
    rows, cols = len(grid), len(grid[0])
    fig, ax = plt.subplots(figsize=(max(4, cols * 0.55), max(2, rows * 0.4 + 0.8)))
    for row in grid:
        for cell in row:
            fill = colour(cell, color)
            if fill.startswith("hsl"):
                h, s, li = (float(v.rstrip("%")) for v in fill[4:-1].split(","))
                fill = colorsys.hls_to_rgb(h / 360, li / 100, s / 100)
            ax.add_patch(Rectangle((cell.col, cell.row), 1, 1, facecolor=fill,
                                   edgecolor="#333", linewidth=0.5))
            ax.text(cell.col + 0.5, cell.row + 0.5, _label(cell, label), ha="center",
                    va="center", fontsize=6, family="monospace")
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_aspect("equal")
    ax.set_xticks([c + 0.5 for c in range(cols)], [str(c) for c in range(cols)], fontsize=5)
    ax.set_yticks([r + 0.5 for r in range(rows)], [str(r) for r in range(rows)], fontsize=5)
    ax.set_title(title or str(layout), fontsize=8, family="monospace")
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------ command line


def conflict_summary(layout, elem_bytes: int) -> str | None:
    """One line on the ldmatrix/stmatrix row pattern, when the layout fits it."""
    try:
        rows, cols = grid_shape(layout)
        if rows == 1 or _rank(layout) != 2:
            return None
        w = row_phase_wavefronts(layout, elem_bytes)
    except ValueError:
        return None
    what = "conflict-free" if w == 1 else f"{w}-way bank conflict"
    return (f"ldmatrix/stmatrix phases (8 rows x 16 bytes, {elem_bytes}-byte elements): "
            f"{what} ({w} wavefront{'s' if w > 1 else ''} per phase)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tilefuse layout",
        description="Print or draw a CuTe layout: each (row, col) cell shows the index it maps "
                    "to, coloured by shared-memory bank or by the thread that owns it.",
        epilog="examples:\n"
               "  tilefuse layout \"(8,64):(64,1)\" --text\n"
               "  tilefuse layout \"(8,64):(64,1)\" --swizzle 3,3,3 -o sw128.svg\n"
               "  tilefuse layout \"Sw<3,3,3> o (8,64):(64,1)\" --label bank --text\n"
               "  tilefuse layout \"(16,8)\" --tv sm80-c -o mma_c.svg\n"
               "  tilefuse layout sm90-c64 --text\n"
               f"fragment presets: {', '.join(PRESETS)}, sm90-c<N>",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("layout", help="a layout such as \"(8,64):(64,1)\" or \"Sw<3,3,3> o (8,64):(64,1)\", "
                                  "or a fragment preset (draws its tile, coloured by thread)")
    p.add_argument("--swizzle", metavar="B,M,S",
                   help="apply Swizzle<B,M,S> to the layout's element offsets (e.g. 3,3,3 is the "
                        "128-byte swizzle for 16-bit elements)")
    p.add_argument("--tv", metavar="TV",
                   help="(thread,value) -> index layout over the grid (column-major), or a "
                        "fragment preset; colours cells by owning thread")
    p.add_argument("--elem-bytes", type=int, default=2, metavar="N",
                   help="bytes per element, for bank numbers (default 2)")
    p.add_argument("--color", choices=("bank", "thread", "none"),
                   help="cell colour (default: thread with --tv, else bank)")
    p.add_argument("--label", choices=("index", "bank", "tv"),
                   help="cell text (default: T<thread>V<value> with --tv, else the index)")
    p.add_argument("--text", action="store_true", help="print the grid as a table")
    p.add_argument("-o", "--output", metavar="FILE", help="write a picture: .svg (or .png with matplotlib)")
    return p


MAX_CELLS = 1 << 16  # a drawing of more cells is unreadable, and a 10^10-cell one never finishes


def main(argv: list[str] | None = None) -> int:
    """`tilefuse layout ...`; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed
        return int(e.code or 0)
    try:
        tv = None
        if args.layout in PRESETS or args.layout.startswith("sm90-c"):
            tv = fragment(args.layout)
            layout = Layout(tuple(tv.tile))
        else:
            layout = parse(args.layout)
        if args.swizzle:
            if getattr(layout, "is_composed", False):
                raise ValueError("the layout is already composed; drop --swizzle")
            layout = ComposedLayout(parse_swizzle(args.swizzle), 0, layout)
        if args.tv:
            tv = fragment(args.tv) if not any(ch in args.tv for ch in "():") else parse(args.tv)
        if args.elem_bytes < 1:
            raise ValueError("--elem-bytes must be >= 1")
        if args.label == "tv" and tv is None:
            raise ValueError("--label tv needs --tv")
        if args.color == "thread" and tv is None:
            raise ValueError("--color thread needs --tv")
        kw = dict(tv=tv, label=args.label, elem_bytes=args.elem_bytes)
        if size(layout) > MAX_CELLS:
            raise ValueError(f"{layout} has {size(layout)} cells, too many to draw (at most {MAX_CELLS}); "
                             f"draw a tile of it")
        print(f"{layout}  size={size(layout)}")
        if args.text or not args.output:
            print(render_text(layout, **kw), end="")
        summary = conflict_summary(layout, args.elem_bytes)
        if summary:
            print(summary)
        if args.output:
            if args.output.lower().endswith(".png"):
                save_png(args.output, layout, color=args.color, **kw)
            elif args.output.lower().endswith(".svg"):
                with open(args.output, "w") as f:
                    f.write(render_svg(layout, color=args.color, **kw))
            else:
                raise ValueError(f"output {args.output!r}: use a .svg or .png file name")
            print(f"wrote {args.output}")
    except BrokenPipeError:  # the reader left (`| head`)
        from ..cli import closed_pipe

        return closed_pipe()
    except OSError as e:  # the output file cannot be written
        print(f"tilefuse layout: error: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, TypeError) as e:
        print(f"tilefuse layout: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
