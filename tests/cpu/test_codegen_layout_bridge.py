"""The map-reduce template takes its index maps from tilefuse.layout (issue 3's last item).

One entry point, `tilefuse.codegen.rowlayout.row_layouts`, builds the layouts of a schedule
(thread -> (lane, slot), (slot, block) -> row, (lane, rank) -> p, (p, j) -> chunk,
(v, (p, j)) -> column, (thread, piece, j) -> shared-memory byte, lane -> warp), and
`mapreduce.render` prints `cgen.c_index` of them. These tests check that:

* every index line of the rendered kernel is, character for character, c_index of its layout;
* the printed C expressions, evaluated, are the layouts' functions at every coordinate;
* evaluating the layouts covers each (row, column) of the kernel exactly once, and the
  coordinates left over are exactly the ones the kernel masks (row_ok, c0 < C);
* the staging layout is injective, 16-byte aligned, inside the CTA's shared memory, and a
  warp's 16-byte copies of one chunk are conflict-free;
* mapreduce.py holds no hand-written thread/block/chunk index formula (a grep).
"""
import inspect
import re
from itertools import product

import pytest

import loop_fixtures as fx
from tilefuse.codegen import mapreduce, rowlayout
from tilefuse.codegen.mapreduce import MapReduceSchedule, default_schedule, render
from tilefuse.layout import Layout, c_index, logical_product, size, wavefronts

# (fixture, R, C, schedule or None for the default): sub-warp rows, multi-warp rows,
# one row per CTA, clusters, the streaming stage with scalar chunks, a masked tail.
CASES = [
    ("rmsnorm", 33, 256, MapReduceSchedule(threads=256, group=8, vector=8, stage="smem", min_blocks=4)),
    ("softmax", 9, 136, MapReduceSchedule(threads=256, group=4, vector=8)),
    ("layernorm", 5, 4000, MapReduceSchedule(threads=256, group=128, vector=8, min_blocks=3)),
    ("cross_entropy", 7, 4096, None),
    ("softmax", 3, 65536, None),
    ("add_rmsnorm", 3, 65536, MapReduceSchedule(threads=256, group=256, vector=8, cluster=4, stage="smem",
                                                pipeline=True)),
    ("softmax", 4, 4097, MapReduceSchedule(threads=128, group=128, vector=1, cluster=4, stage="stream")),
    ("rmsnorm", 6, 1000, MapReduceSchedule(threads=256, group=32, vector=8, stage="smem", min_blocks=3)),
    ("rmsnorm", 1001, 256, MapReduceSchedule(threads=128, group=8, vector=8, batch=2)),  # a batch of rows
    ("layernorm", 37, 136, MapReduceSchedule(threads=64, group=8, vector=8, batch=4)),
]


def _case(name, R, C, sched):
    k = fx.BUILDERS[name](R, C, "bf16")
    sched = sched or default_schedule(k, "sm_90a")
    src = render(k, sched, "sm_90a")
    nchunk, _ = mapreduce._plan_chunks(C, sched.vector, sched.group * sched.cluster)
    pieces = max(1, sched.vector * 2 // 16)
    lay = rowlayout.row_layouts(threads=sched.threads, group=sched.group, cluster=sched.cluster,
                                vector=sched.vector, nchunk=nchunk, pieces=pieces, batch=sched.batch,
                                # a source taking its row count as an argument is written for any count
                                rows=R if src.rows is None else mapreduce.ROWS_LAYOUT)
    return k, sched, src, lay, nchunk


def _c_fn(expr: str):
    """A printed C index expression as a Python function of its variables (non-negative
    ints, where C's / is //)."""
    code = compile(re.sub(r"(?<![/])/(?![/])", "//", expr), "<c>", "eval")
    return lambda **env: eval(code, {"__builtins__": {}}, env)  # noqa: S307 - our own generated arithmetic


def _lines(src, lhs):
    body = src.source.split('extern "C"')[1]
    return [m.group(1) for m in re.finditer(rf"{re.escape(lhs)} = (.*?);", body)]


@pytest.mark.parametrize("name,R,C,sched", CASES, ids=lambda x: str(x) if not isinstance(x, MapReduceSchedule) else "s")
def test_rendered_index_lines_are_c_index_of_the_layouts(name, R, C, sched):
    k, sched, src, lay, nchunk = _case(name, R, C, sched)
    assert _lines(src, "const int slot") == [c_index(lay.slot, "threadIdx.x")]
    assert _lines(src, "const int lane") == [c_index(lay.lane, "threadIdx.x")]
    rb = "rowblock" if sched.cluster > 1 else "blockIdx.x"
    if sched.batch == 1:
        assert _lines(src, "const long long r") == [c_index(lay.row, ("slot", rb))]
    else:  # each row of the batch: once where its chunks are loaded, once where its body runs
        assert _lines(src, "const long long r") == [c_index(lay.row, ("slot", b, rb)) for b in range(sched.batch)] * 2
    if sched.cluster > 1:
        assert _lines(src, "const unsigned rank") == [c_index(lay.rank, "blockIdx.x")]
        assert _lines(src, "const int rowblock") == [c_index(lay.rowblock, "blockIdx.x")]
    assert _lines(src, "const int p") == [c_index(lay.p, ("lane", "rank" if sched.cluster > 1 else 0))]
    # every chunk's first column, in every pass and in the staging loop: (chunk layout) * V
    q = c_index(lay.chunk, ("p", "j"))
    want_c0 = q if sched.vector == 1 else f"({q}) * {sched.vector}"
    c0s = _lines(src, "const int c0")
    assert c0s and set(c0s) == {want_c0}
    if sched.stage == "smem":
        offs = re.findall(r"smem0 \+ \d+u \+ \(unsigned\)\((.*?)\)\)?[,;]", src.source)
        assert offs and set(offs) <= {c_index(lay.smem, ("threadIdx.x", i, "j")) for i in range(2)}
    if sched.group > 32:
        assert "(lane >> 5)" == c_index(lay.warp, "lane", shifts=True)
        assert "[slot][(lane >> 5)]" in src.source


@pytest.mark.parametrize("name,R,C,sched", CASES, ids=lambda x: str(x) if not isinstance(x, MapReduceSchedule) else "s")
def test_printed_expressions_compute_the_layouts(name, R, C, sched):
    """Evaluate the printed C at every thread, block and chunk: it is the layout's function."""
    k, sched, src, lay, nchunk = _case(name, R, C, sched)
    lane, slot, rank, rowblock = (_c_fn(e) for e in (lay.c_lane(), lay.c_slot(), lay.c_rank(), lay.c_rowblock()))
    for tid in range(sched.threads):
        assert lane(threadIdx=_Idx(tid)) == lay.lane(tid)
        assert slot(threadIdx=_Idx(tid)) == lay.slot(tid)
        assert lay.thread(lay.lane(tid), lay.slot(tid)) == tid  # the digits are threadIdx.x's
    for bid in range(src.grid[0]):
        assert rank(blockIdx=_Idx(bid)) == lay.rank(bid)
        assert rowblock(blockIdx=_Idx(bid)) == lay.rowblock(bid)
        assert lay.block(lay.rank(bid), lay.rowblock(bid)) == bid
    column = _c_fn(lay.c_column("v"))
    P = sched.group * sched.cluster
    want = {}
    for v, p, j in product(range(sched.vector), range(P), range(nchunk)):
        want[column(p=p, j=j, v=v)] = (v, p, j)
    # the layout's own function, evaluated once per column it produces
    assert all(lay.column(v, (p, j)) == col for col, (v, p, j) in want.items())
    assert sorted(want) == list(range(sched.vector * P * nchunk)), "the printed columns are a bijection"


class _Idx:
    """threadIdx / blockIdx stand-in for evaluating printed C."""

    def __init__(self, x):
        self.x = x


@pytest.mark.parametrize("name,R,C,sched", CASES, ids=lambda x: str(x) if not isinstance(x, MapReduceSchedule) else "s")
def test_layouts_cover_every_element_exactly_once(name, R, C, sched):
    """Over the whole grid, (thread, block, chunk, lane of the chunk) -> (row, column) hits
    each element of the R x C space once; what falls outside is exactly what is masked."""
    k, sched, src, lay, nchunk = _case(name, R, C, sched)
    assert lay.column == logical_product(Layout(sched.vector, 1), lay.chunk)
    seen = {}
    masked = 0
    for bid in range(src.grid[0]):
        rank, rb = lay.rank(bid), lay.rowblock(bid)
        for tid, b in product(range(sched.threads), range(sched.batch)):
            row = lay.row(lay.slot(tid), rb) if sched.batch == 1 else lay.row(lay.slot(tid), b, rb)
            p = lay.p(lay.lane(tid), rank)
            for j in range(nchunk):
                c0 = lay.column(0, (p, j))
                if not (row < R and c0 < C):  # row_ok && c0 < C
                    masked += 1
                    continue
                # a chunk is V consecutive columns (column = logical_product(V:1, chunk))
                assert c0 + sched.vector <= C, "an unmasked chunk runs past the row"
                assert (row, c0) not in seen, f"chunk at ({row}, {c0}) covered twice"
                seen[(row, c0)] = (bid, tid, b, j)
    assert len(seen) * sched.vector == R * C
    assert masked * sched.vector == src.grid[0] * sched.threads * sched.batch * nchunk * sched.vector - R * C


def test_column_layout_is_the_chunk_layout_times_the_vector():
    lay = rowlayout.row_layouts(threads=256, group=256, cluster=4, vector=8, nchunk=8)
    assert lay.column == logical_product(Layout(8, 1), lay.chunk)
    assert str(lay.column) == "(8,(1024,8)):(1,(8,8192))"
    assert lay.c_column("v") == "(p + j * 1024) * 8 + v"


@pytest.mark.parametrize("threads,pieces,nchunk", [(256, 1, 4), (128, 2, 8), (1024, 1, 8)])
def test_staging_layout_is_injective_aligned_and_conflict_free(threads, pieces, nchunk):
    lay = rowlayout.row_layouts(threads=threads, group=threads, cluster=1, vector=8, nchunk=nchunk, pieces=pieces)
    offsets = [lay.smem(t, i, j) for t in range(threads) for i in range(pieces) for j in range(nchunk)]
    assert len(set(offsets)) == len(offsets) == size(lay.smem)
    assert all(o % 16 == 0 for o in offsets) and max(offsets) + 16 == 16 * threads * pieces * nchunk
    for i, j in product(range(pieces), range(nchunk)):
        warp = [lay.smem(t, i, j) for t in range(32)]
        # 32 threads x 16 bytes = 512 bytes: four phases of 8 threads, one wavefront each
        assert all(wavefronts(warp[8 * ph: 8 * ph + 8], 16) == 1 for ph in range(4))


def test_render_builds_its_layouts_in_one_place_and_writes_no_index_formula():
    """grep: the template's thread/block/chunk arithmetic all comes from row_layouts."""
    text = inspect.getsource(mapreduce)
    assert text.count("row_layouts(") == 1
    code = "\n".join(line.split("#")[0] for line in text.splitlines())
    for pattern in (r"threadIdx\.x\s*[/%*]", r"blockIdx\.x\s*[/%*]", r"j \* \{", r"\* \{ctx\.P\}",
                    r"\(j \* ", r"\+ threadIdx\.x\)"):
        assert not re.search(pattern, code), f"hand-written index formula in mapreduce.py: {pattern}"
