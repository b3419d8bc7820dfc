"""Drawing layouts: SVG, text tables, PNG through matplotlib, and the command line."""
import sys
import types
import xml.etree.ElementTree as ET

import pytest

from tilefuse.layout import Layout, parse, sm80_16x8x16_c
from tilefuse.layout.draw import main, render_svg, render_text, save_png

SVG = "{http://www.w3.org/2000/svg}"


def test_text_table():
    assert render_text(Layout((4, 2), (1, 4))) == (
        "     0 1\n"
        "   +----\n"
        "0  | 0 4\n"
        "1  | 1 5\n"
        "2  | 2 6\n"
        "3  | 3 7\n"
    )


def test_text_table_of_thread_owners():
    text = render_text(Layout((16, 8)), tv=sm80_16x8x16_c())
    assert text.splitlines()[2].split() == ["0", "|", "T0V0", "T0V1", "T1V0", "T1V1", "T2V0",
                                            "T2V1", "T3V0", "T3V1"]


def test_svg_is_well_formed_with_one_rect_per_cell():
    layout = parse("Sw<3,3,3> o (8,64):(64,1)")
    root = ET.fromstring(render_svg(layout))
    rects = root.findall(f"{SVG}rect")
    assert len(rects) == 1 + 8 * 64  # background + cells
    texts = [t.text for t in root.findall(f"{SVG}text")]
    assert str(layout) in texts and "72" in texts  # swizzled index of (1, 0)
    # bank colouring: the 8 rows of column chunk 0 get 8 different colours
    fills = [r.get("fill") for r in rects[1:]]
    assert len({fills[64 * r] for r in range(8)}) == 8


def test_svg_coloured_by_thread():
    root = ET.fromstring(render_svg(Layout((16, 8)), tv=sm80_16x8x16_c()))
    fills = {r.get("fill") for r in root.findall(f"{SVG}rect")[1:]}
    assert len(fills) == 32


def test_mismatched_fragment_is_an_error():
    with pytest.raises(ValueError, match="covers a 16x8 tile"):
        render_text(Layout((8, 8)), tv=sm80_16x8x16_c())


def test_rank3_is_an_error():
    with pytest.raises(ValueError, match="rank-1 or rank-2"):
        render_text(Layout((2, 2, 2)))


def test_main_writes_svg_and_reports_conflicts(tmp_path, capsys):
    out = tmp_path / "sw.svg"
    assert main(["(8,64):(64,1)", "--swizzle", "3,3,3", "-o", str(out)]) == 0
    ET.parse(out)
    stdout = capsys.readouterr().out
    assert "Sw<3,3,3> o (8,64):(64,1)" in stdout and "conflict-free" in stdout
    assert main(["(8,64):(64,1)", "--text"]) == 0
    assert "8-way bank conflict" in capsys.readouterr().out


def test_main_text_and_presets(capsys):
    assert main(["(4,2):(1,4)", "--text"]) == 0
    assert "3  | 3 7" in capsys.readouterr().out
    assert main(["sm80-c", "--text"]) == 0
    assert "T31V3" in capsys.readouterr().out
    assert main(["(16,8)", "--tv", "((4,8),(2,2)):((32,1),(16,8))", "--text"]) == 0
    assert "T31V3" in capsys.readouterr().out


def test_main_errors_are_clear(capsys, tmp_path):
    assert main(["(4,2):(1,4,8)"]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["(4,2)", "-o", str(tmp_path / "x.pdf")]) == 2
    assert ".svg or .png" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "--swizzle" in capsys.readouterr().out


def test_png_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["(8,8):(8,1)", "-o", str(tmp_path / "x.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_png_through_matplotlib(monkeypatch, tmp_path):
    """save_png against a stand-in matplotlib that records what is drawn."""
    drawn = {"patches": 0, "texts": []}

    class Ax:
        def add_patch(self, p):
            drawn["patches"] += 1

        def text(self, x, y, s, **kw):
            drawn["texts"].append(s)

        def __getattr__(self, name):  # set_xlim, set_title, ...
            return lambda *a, **k: None

    class Fig:
        def savefig(self, path, **kw):
            open(path, "wb").write(b"\x89PNG")

    mpl = types.ModuleType("matplotlib")
    mpl.use = lambda backend: None
    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.subplots = lambda **kw: (Fig(), Ax())
    pyplot.close = lambda fig: None
    patches = types.ModuleType("matplotlib.patches")
    patches.Rectangle = lambda *a, **k: ("rect", a, k)
    mpl.pyplot, mpl.patches = pyplot, patches
    for name, mod in (("matplotlib", mpl), ("matplotlib.pyplot", pyplot),
                      ("matplotlib.patches", patches)):
        monkeypatch.setitem(sys.modules, name, mod)
    path = tmp_path / "x.png"
    save_png(str(path), parse("Sw<3,3,3> o (8,64):(64,1)"))
    assert path.read_bytes() == b"\x89PNG"
    assert drawn["patches"] == 512 and "72" in drawn["texts"]


def test_a_layout_too_large_to_draw_is_refused_at_once(capsys):
    """10^10 cells never finished drawing; now one line and status 2."""
    assert main(["(100000,100000)", "--text"]) == 2
    err = capsys.readouterr().err
    assert "too many to draw" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["layout", "(256,256):(256,1)", "--text"],
                                  ["compile", "-c", "nn.Linear(512, 512, dtype=torch.bfloat16)(F.gelu(nn.Linear(512, 512, "
                                   "dtype=torch.bfloat16)(torch.randn(512, 512, dtype=torch.bfloat16))))",
                                   "--ir", "cuda", "--ir", "loop"]])  # (each well over a pipe's 64 KB)
def test_a_reader_that_leaves_early_ends_the_command_quietly(argv):
    """`tilefuse ... | head -1`: status 0 and nothing on stderr, as Unix tools do (it was
    `cannot write None: Broken pipe` and status 2 for layout, status 1 with rich's exit for compile)."""
    import subprocess

    p = subprocess.Popen([sys.executable, "-m", "tilefuse.cli", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and err == "", err
