"""Stream-K in the sm_90a GEMM, without a GPU: how CTAs share the last waves' K steps (the
Python mirror, and the kernel's own C++ loop compiled for the host against it), what the
kernel renders, when the default takes it, and what it refuses."""
import shutil
import subprocess

import pytest
from hypothesis import given, strategies as st

from tilefuse.codegen import epilogue as epi
from tilefuse.codegen import gemm_sm90 as g
from tilefuse.runtime import nvrtc


def _shares(tiles, k_iters, workers):
    return [g.stream_k_units(tiles, k_iters, workers, w) for w in range(workers)]


@given(workers=st.integers(1, 140), extra=st.integers(0, 600), k_iters=st.integers(1, 80))
def test_every_k_step_of_every_tile_runs_once_and_a_tile_is_cut_at_most_once(workers, extra, k_iters):
    """Over all CTAs the units cover each (tile, K step) exactly once. A tile is whole, or cut
    once into a head (K steps from 0) run by CTA w and a tail (to the end) run by CTA w + 1:
    the kernel's slot pair for the cut is indexed by w + 1, from either side. The shared K
    steps are spread evenly (CTAs differ by at most one)."""
    tiles = workers + extra
    shares = _shares(tiles, k_iters, workers)
    seen = {}
    for w, units in enumerate(shares):
        for t, lo, hi in units:
            assert 0 <= lo < hi <= k_iters
            for kt in range(lo, hi):
                assert (t, kt) not in seen, f"tile {t} step {kt} twice"
                seen[(t, kt)] = w
    assert len(seen) == tiles * k_iters
    pieces = {}
    for w, units in enumerate(shares):
        for t, lo, hi in units:
            pieces.setdefault(t, []).append((lo, hi, w))
    for t, ps in pieces.items():
        assert len(ps) <= 2, f"tile {t} cut more than once: {ps}"
        if len(ps) == 2:
            (lo0, hi0, w0), (lo1, hi1, w1) = sorted(ps)
            assert lo0 == 0 and hi0 == lo1 and hi1 == k_iters and w1 == w0 + 1
    sk = g.stream_k_tiles(tiles, workers) * k_iters
    per = [sum(hi - lo for t, lo, hi in units if t < g.stream_k_tiles(tiles, workers)) for units in shares]
    assert sum(per) == sk and max(per) - min(per) <= 1


@given(workers=st.integers(1, 140), extra=st.integers(0, 600), k_iters=st.integers(1, 80))
def test_each_cta_starts_at_k_step_0_and_its_tail_ends_its_share(workers, extra, k_iters):
    """The order that keeps CTAs in step along K (so L2 serves the rows of A and B they share):
    every CTA's first unit starts at K step 0; a whole tile, then the head, then the tail,
    then whole tiles a wave apart."""
    tiles = workers + extra
    sk_tiles = g.stream_k_tiles(tiles, workers)
    for w, units in enumerate(_shares(tiles, k_iters, workers)):
        assert units and units[0][1] == 0
        kinds = ["tail" if lo else "head" if hi < k_iters else "whole" for _, lo, hi in units]
        shared = [x for (t, _, _), x in zip(units, kinds) if t < sk_tiles]
        assert shared == sorted(shared, key=["whole", "head", "tail"].index)
        rest = [t for t, _, _ in units if t >= sk_tiles]
        assert rest == list(range(sk_tiles + w, tiles, workers))


def test_tiles_in_whole_waves_are_not_shared_and_less_than_a_wave_is_refused():
    assert g.stream_k_tiles(264, 132) == 0
    assert g.stream_k_tiles(512, 132) == 132 + 116
    with pytest.raises(g.GemmError, match="fewer than the 132"):
        g.stream_k_tiles(100, 132)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
@pytest.mark.parametrize("tiles,k_iters,workers", [(512, 64, 132), (544, 65, 132), (1056, 9, 7), (50, 16, 5),
                                                   (256, 32, 200), (133, 1, 132)])
def test_the_kernels_unit_loop_runs_the_mirrors_units(tmp_path, tiles, k_iters, workers):
    """The C++ `tf_units` the kernel walks, compiled for the host, yields exactly
    stream_k_units' sequence for every CTA."""
    struct = g.STREAM_K_PRELUDE[g.STREAM_K_PRELUDE.index("struct tf_units"):]
    src = tmp_path / "units.cpp"
    src.write_text(f"""#include <cstdio>
#define __device__
#define __forceinline__ inline
#define STREAM_K {workers}
#define K_ITERS {k_iters}
{struct}
int main() {{
  const int tiles = {tiles};  // (a kernel argument where M is: the struct must not fold it)
  for (int w = 0; w < STREAM_K; ++w) {{
    tf_units u(w, tiles);
    int t, lo, hi;
    while (u.next(t, lo, hi)) printf("%d %d %d %d\\n", w, t, lo, hi);
  }}
}}
""")
    exe = tmp_path / "units"
    subprocess.run(["g++", "-O1", "-o", str(exe), str(src)], check=True)
    got = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n"):
        if line:
            w, t, lo, hi = map(int, line.split())
            got.setdefault(w, []).append((t, lo, hi))
    assert [got.get(w, []) for w in range(workers)] == _shares(tiles, k_iters, workers)


def test_the_kernel_walks_units_and_meets_cut_tiles_in_a_slot_pair():
    """Producer and consumers walk the same `tf_units`; a cut tile's halves meet in its cut's
    slot pair (f32, a warpgroup's share per half), one counter per cut and warpgroup; the
    grid is exactly the CTAs the shares were cut for."""
    p = g.GemmProblem(4096, 4096, 4096)
    src = g.render(p, g.GemmSchedule(128, 256, stages=4, stream_k=132))
    code = src.source
    assert "#define STREAM_K 132" in code and "#define TILES_M tf_tiles_m" in code
    assert code.count("tf_units units(first, TILES);") == 2 and code.count("for (int kt = k_lo; kt < k_hi; ++kt)") == 2
    assert "if (tid == 0) in = tf_ld_acquire(flag);" in code and "last = atomicAdd(flag, 1) == 1;" in code
    assert "if (tid == 0) *flag = 0;" in code
    assert src.exact_grid and src.grid_tiles == 132
    assert src.workspace == 132 * 2 * 128 * 256 and src.flags == 132 * 2
    assert "sk132" in src.name and "stream-K over 132" in str(src.schedule)
    pair = g.render(g.GemmProblem(8192, 4096, 4096), g.GemmSchedule(128, 256, stages=4, cluster_m=2, stream_k=132))
    assert "#define STREAM_K 66" in pair.source and pair.grid_tiles == 66 and pair.exact_grid
    assert pair.workspace == 132 * 2 * 128 * 256 and pair.flags == 132 * 2
    plain = g.render(p, g.GemmSchedule(128, 256, stages=4))
    assert not plain.exact_grid and "tf_units" not in plain.source and "tf_ws" not in plain.source


def test_stream_k_is_refused_where_it_cannot_run():
    with pytest.raises(g.GemmError, match="split-K"):
        g.GemmSchedule(128, 128, split_k=2, stream_k=132)
    with pytest.raises(g.GemmError, match="whole 2-CTA clusters"):
        g.GemmSchedule(128, 256, cluster_m=2, stream_k=131)
    with pytest.raises(g.GemmError, match="fewer than"):
        g.render(g.GemmProblem(512, 4096, 4096), g.GemmSchedule(128, 256, stream_k=132))


@pytest.mark.parametrize("sched", [g.GemmSchedule(128, 256, stages=4, stream_k=12),
                                   g.GemmSchedule(128, 256, stages=4, cluster_m=2, stream_k=12),
                                   g.GemmSchedule(64, 64, stages=12, consumers=1, tma_store=False, stream_k=12)],
                         ids=str)
def test_stream_k_kernels_compile_for_sm90a_without_spills(sched):
    ep = epi.standard(1000, 1024, "bf16", bias="col", activation="gelu", residual=True)
    src = g.render(g.GemmProblem(1000, 1024, 520, "bf16", epilogue=ep), sched)
    assert "tf_units" in src.source
    cubin = nvrtc.compile_cuda(src.source, src.name, "sm_90a")
    assert cubin.info.clean, cubin.info


def test_default_takes_stream_k_only_where_whole_tiles_waste_the_last_wave():
    """More than 6% of the time idle in a short last wave: stream-K over every SM (cluster
    pairs included); issue 4's shapes waste 3% or less and stay whole."""
    def sk(m, n, k):
        return g.default_schedule(g.GemmProblem(m, n, k)).stream_k
    assert sk(1152, 4096, 4096) == 132       # 144 tiles: 1.09 waves
    assert sk(4096, 4352, 4096) == 132       # 544 tiles: 4.12 waves
    assert sk(8192, 4352, 4096) == 132       # 544 tile pairs on 66 clusters: 8.24 waves
    for shape in [(4096, 4096, 4096), (6144, 6144, 6144), (8192, 8192, 8192), (8192, 11008, 4096),
                  (8192, 4096, 14336), (16384, 6144, 4096), (512, 4096, 4096), (128, 4096, 4096)]:
        assert sk(*shape) == 0, shape
