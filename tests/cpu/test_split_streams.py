"""A row read as pieces of m contiguous elements, piece c // m at a fixed stride
(`mapreduce._split_load`): attention's heads merged back into rows, [B, H, S, D] read at
(b, c // D, s, c % D). Such a load is a stream of 16-byte chunks (each inside one piece) where
it had been 8 scalar loads a chunk; the chunk's address is base(row) + (c0 // m) * S + c0 % m."""
from __future__ import annotations

import pytest
import torch

import tilefuse
from tilefuse.codegen import mapreduce
from tilefuse.loop import ir
from tilefuse.runtime.launch import compile_source_only


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path_factory.mktemp("cubins")))


def heads_merge(x):
    B, H, S, D = x.shape
    return x.transpose(1, 2).reshape(B, S, H * D)


def _kernel(fn, *shapes, dtype=torch.bfloat16):
    p = tilefuse.compile(fn, tuple(torch.randn(*s, dtype=dtype) for s in shapes))
    (lw,) = p.kernels.values()
    return lw.kernel


def test_the_heads_index_is_pieces_of_the_head_dim_a_head_apart():
    c = "c"
    buf = ir.Buffer("x", (8, 32, 1024, 128), "bf16", "in")
    r = ir.Var("r")
    index = (ir.IBin("//", r, ir.IConst(1024)), ir.IBin("//", ir.Var(c), ir.IConst(128)),
             ir.IBin("%", r, ir.IConst(1024)), ir.IBin("%", ir.Var(c), ir.IConst(128)))
    base, split = mapreduce._split_load(buf, index, c, 8)
    assert split == (128, 1024 * 128)
    assert base[1] == base[3] == ir.IConst(0) and base[0] == index[0] and base[2] == index[2]
    assert mapreduce._split_load(buf, index, c, 256) is None  # a chunk would cross a piece


@pytest.mark.parametrize("m, vector_ok", [(128, True), (64, True), (8, True), (100, False)])
def test_a_split_read_is_a_stream_where_its_chunks_stay_inside_a_piece(m, vector_ok):
    k = _kernel(heads_merge, (2, 4, 16, m))
    parts = ir.row_kernel_parts(k)
    V = mapreduce._choose_vector(k, parts)
    ana = mapreduce._analyse(k, parts, V)
    splits = [st for st in ana.in_streams.values() if st.split is not None]
    assert bool(splits) == vector_ok and (not splits or splits[0].split == (m, 16 * m))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_heads_merge_reads_vector_chunks_and_builds_clean(dtype, arch):
    k = _kernel(heads_merge, (2, 8, 64, 128), dtype=dtype)
    src, cubin = compile_source_only(k, arch, mapreduce.default_schedule(k, arch))
    assert "(c0 / 128) * 8192 + c0 % 128)" in src.source  # (a head's S x D = 64 x 128 elements apart)
    assert cubin.info.clean
    x = next(b.name for b in k.params if b.role == "in")
    assert dict(src.alignment).get(x) == src.schedule.vector * dtype.itemsize > dtype.itemsize


def test_a_split_store_stays_scalar():
    """Only loads take pieces: a store's chunk address is base + c0 (_emit_out_chunks)."""
    k = _kernel(lambda x: x.reshape(2, 16, 4, 64).transpose(1, 2).contiguous() * 2, (2, 16, 256))
    parts = ir.row_kernel_parts(k)
    ana = mapreduce._analyse(k, parts, mapreduce._choose_vector(k, parts))
    assert all(st.split is None for st in ana.out_streams.values())
