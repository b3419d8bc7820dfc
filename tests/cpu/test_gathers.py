"""Gathers computed in map-reduce kernels (each was a torch.gather / aten.embedding extern):
F.embedding, index_select, x[idx] and torch.gather lower to ir.Gather, which a kernel computes
elementwise in its index, loading its table (an input, a weight or another kernel's result) at
the index it reads. An embedding's token id is read once a row and its table row in 16-byte
loads, so embedding + LayerNorm is one kernel. An index out of range gives NaN, never a read
outside the table (PyTorch stops with a device-side assert). The kernels compute what PyTorch
does (the Loop IR interpreter) and build for sm_90a and sm_80 with no spills."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.runtime.launch import compile_source_only


def _families(p):
    return [s.family for s in p.plan.steps if s.family != "alias" and not s.view]


def _one_kernel(p):
    assert _families(p) == ["mapreduce"], str(p.plan)
    (lw,) = p.kernels.values()
    return lw.kernel


def test_embedding_then_layernorm_is_one_kernel_reading_only_its_tokens_rows():
    torch.manual_seed(0)
    w, ids = torch.randn(1000, 64), torch.randint(0, 1000, (3, 7))
    fn = lambda w, ids: F.layer_norm(F.embedding(ids, w), (64,))  # noqa: E731
    p = tilefuse.compile(fn, (w, ids))
    _one_kernel(p)
    (step,) = [s for s in p.plan.steps if s.family == "mapreduce"]
    # the 256 KB table counts as the 21 rows it reads, not whole
    assert step.bytes <= 2 * 21 * 64 * 4 + ids.numel() * 8, str(p.plan)
    torch.testing.assert_close(p(w, ids), fn(w, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, fn", [
    ("index_select 0", lambda x, i: x.index_select(0, i.clamp(0, 5)) * 2),
    ("index_select 1", lambda x, i: torch.sigmoid(x.index_select(1, i.clamp(0, 9)))),
    ("index_select 2", lambda x, i: x.index_select(2, i.clamp(0, 11)) + 1),
    ("x[i] negative", lambda x, i: x[i.clamp(0, 11) - 6] * 3),
    ("x[:, i]", lambda x, i: x[:, i.clamp(0, 19) - 10].exp()),
    ("x[..., i]", lambda x, i: x[..., i.clamp(0, 11)] - 1),
    ("gather last", lambda x, i: torch.gather(x, 2, i.clamp(0, 11).reshape(1, 1, -1).expand(6, 10, -1)) * 2),
    ("gather middle", lambda x, i: torch.gather(x, 1, i.clamp(0, 9).reshape(1, -1, 1).expand(6, -1, 12)).relu()),
])
def test_gathers_compute_what_pytorch_does(name, fn):
    torch.manual_seed(1)
    x, i = torch.randn(6, 10, 12), torch.randint(-3, 25, (9,))
    p = tilefuse.compile(fn, (x, i))
    assert not [s for s in p.plan.steps if s.family == "extern" and not s.view], str(p.plan)
    torch.testing.assert_close(p(x, i), fn(x, i), rtol=1e-6, atol=1e-6)


def test_a_two_dim_index_keeps_its_shape():
    torch.manual_seed(2)
    x, i = torch.randn(6, 10), torch.randint(0, 6, (3, 4))
    fn = lambda x, i: x[i] * 2 + x.index_select(0, i[0])[None]  # noqa: E731
    p = tilefuse.compile(fn, (x, i))
    torch.testing.assert_close(p(x, i), fn(x, i))


def test_an_index_out_of_range_gives_nan_not_a_read_outside_the_table():
    w = torch.randn(10, 8)
    ids = torch.tensor([0, 9, 10, -1, 3])
    p = tilefuse.compile(lambda w, ids: F.embedding(ids, w) * 2, (w, torch.zeros(5, dtype=torch.long)))
    got = p(w, ids)
    assert got[[2, 3]].isnan().all()
    torch.testing.assert_close(got[[0, 1, 4]], w[[0, 9, 3]] * 2)


def test_a_table_computed_in_the_program_and_read_whole_too_is_written_first_then_gathered():
    torch.manual_seed(3)
    w, ids = torch.randn(50, 16), torch.randint(0, 50, (8,))
    fn = lambda w, ids: (lambda t: (F.embedding(ids, t) + 1, t * 2))(torch.tanh(w))  # noqa: E731
    p = tilefuse.compile(fn, (w, ids))
    assert _families(p) == ["mapreduce", "mapreduce"], str(p.plan)
    for got, want in zip(p(w, ids), fn(w, ids)):
        torch.testing.assert_close(got, want)


def test_a_table_that_is_a_map_of_one_in_memory_is_computed_at_the_gathered_rows():
    """embedding(ids, tanh(w)) is tanh(embedding(ids, w)) (rules/gather_sink.py): one kernel,
    tanh of the 8 rows read rather than of all 50 written and read back."""
    torch.manual_seed(3)
    w, ids = torch.randn(50, 16), torch.randint(0, 50, (8,))
    fn = lambda w, ids: F.embedding(ids, torch.tanh(w)) + 1  # noqa: E731
    p = tilefuse.compile(fn, (w, ids))
    assert _families(p) == ["mapreduce"], str(p.plan)
    torch.testing.assert_close(p(w, ids), fn(w, ids))


def test_an_integer_table_or_gathers_switched_off_leave_torch_gather():
    x, i = torch.randint(0, 9, (6, 10)), torch.randint(0, 6, (4,))
    p = tilefuse.compile(lambda x, i: x.index_select(0, i) * 2, (x, i))
    assert "torch.gather" in str(p.plan), str(p.plan)
    assert torch.equal(p(x, i), x.index_select(0, i) * 2)


def test_tilefuse_gathers_0_leaves_torch_gather(monkeypatch):
    monkeypatch.setenv("TILEFUSE_GATHERS", "0")
    w, ids = torch.randn(50, 16), torch.randint(0, 50, (8,))
    p = tilefuse.compile(lambda w, ids: F.embedding(ids, w) * 2, (w, ids))
    assert "torch.gather" in str(p.plan), str(p.plan)
    torch.testing.assert_close(p(w, ids), F.embedding(ids, w) * 2)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_an_embedding_reads_its_table_rows_in_16_byte_loads_and_builds_without_spills(dtype, arch):
    w, ids = torch.randn(32000, 4096, dtype=dtype), torch.randint(0, 32000, (2, 64))
    k = _one_kernel(tilefuse.compile(lambda w, ids: F.rms_norm(F.embedding(ids, w), (4096,)), (w, ids)))
    src, cubin = compile_source_only(k, arch)
    assert not (cubin.info.spill_stores or cubin.info.spill_loads), cubin.info
    # the table's loads: one guarded 16-byte load a chunk, at the row the clamped id names
    table = [line for line in src.source.splitlines() if "< 32000ULL" in line]
    assert table and all("tf_ld16(" in line for line in table), table


def test_a_gather_along_the_row_reads_per_element_and_builds():
    """An index that varies along the row (torch.gather over the last dim) loads one element
    each, guarded by the clamp."""
    x, i = torch.randn(64, 4096, dtype=torch.bfloat16), torch.randint(0, 4096, (64, 4096))
    k = _one_kernel(tilefuse.compile(lambda x, i: torch.gather(x, 1, i) * 2, (x, i)))
    src, cubin = compile_source_only(k, "sm_90a")
    assert not (cubin.info.spill_stores or cubin.info.spill_loads), cubin.info


def test_gpt2_token_and_position_embeddings_and_their_layernorm_are_one_kernel():
    """The position embedding [S, D] broadcast over the batch joins the token embedding's
    kernel (fusion.join_sibling: a gather is a load, read again for each sequence)."""
    torch.manual_seed(5)
    ids, wte, wpe = torch.randint(0, 500, (4, 64)), torch.randn(500, 128), torch.randn(64, 128)
    fn = lambda ids, wte, wpe: F.layer_norm(F.embedding(ids, wte) + F.embedding(torch.arange(64), wpe), (128,))  # noqa: E731
    p = tilefuse.compile(fn, (ids, wte, wpe))
    _one_kernel(p)
    torch.testing.assert_close(p(ids, wte, wpe), fn(ids, wte, wpe), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, fn", [
    ("embedding of a computed table", lambda w, i: F.embedding(i, w * 2) + 1),
    ("embedding of a cast table", lambda w, i: F.embedding(i, w.bfloat16()).float() + 1),
    ("index of a softmax", lambda w, i: w.softmax(-1)[i]),
])
def test_a_computed_table_reshaped_for_a_two_dim_index_is_read_where_it_is_written(name, fn):
    """The table's reshape to the result's rank is computed in its producer's kernel and
    written under its own name: the gather binds that, not the tensor under it (nothing
    writes that one; a review found the kernel reading an unwritten buffer)."""
    torch.manual_seed(6)
    w, i = torch.randn(10, 4), torch.randint(0, 10, (3, 5))
    p = tilefuse.compile(fn, (w, i))
    torch.testing.assert_close(p(w, i), fn(w, i))


def test_a_table_computed_where_it_is_read_is_written_first():
    """A map of indices alone is computed in the kernels that read it; used as a gather's table
    too, it must be written (a gather loads its table from memory)."""
    x = torch.randn(3, 8)

    def fn(x):
        t = torch.arange(8, dtype=torch.float32) * 2
        return x + t + t.flip(0)

    p = tilefuse.compile(fn, (x,))
    torch.testing.assert_close(p(x), fn(x))


@pytest.mark.parametrize("gathers", ["1", "0"])
def test_int32_ids_gather_right_in_a_kernel_and_in_torch_gather(gathers, monkeypatch):
    """torch.gather with an int32 index of a stride-0 dim returns wrong rows (torch 2.13 CPU):
    the extern path gives it int64."""
    monkeypatch.setenv("TILEFUSE_GATHERS", gathers)
    torch.manual_seed(7)
    x, i = torch.randn(6, 3), torch.randint(0, 3, (3,), dtype=torch.int32)
    for fn in (lambda x, i: F.embedding(i, x.t()), lambda x, i: x.t()[i] * 2, lambda x, i: x.t().index_select(0, i) * 2,
               lambda x, i: x[i] * 2):
        p = tilefuse.compile(fn, (x, i))
        torch.testing.assert_close(p(x, i), fn(x, i))


def test_a_mask_indexed_by_positions_makes_new_sizes_of_the_right_shape():
    """resize.family makes a new size's program from a compiled one, running each extern on
    meta tensors of the new shapes: the gather's broadcast follows the tensors given, not the
    compiled size."""
    from tilefuse.runtime import resize

    fn = lambda m, pos: m[pos]  # noqa: E731
    progs = [tilefuse.compile(fn, (torch.randint(0, 2, (n, n)), torch.tensor([n - 1]))) for n in (6, 8)]
    fam = resize.family(*progs)
    assert isinstance(fam, resize.Family), fam
    m, pos = torch.randint(0, 2, (12, 12)), torch.tensor([11])
    made = fam.at([tuple(m.shape), tuple(pos.shape)])
    assert made is not None
    got = made(m, pos)
    assert got.shape == fn(m, pos).shape and torch.equal(got, fn(m, pos))


def test_a_gather_of_a_0d_tensor_stays_with_pytorch():
    fn, ins = (lambda s, i: s.index_select(0, i) * 2), (torch.tensor(2.0), torch.tensor([0]))
    p = tilefuse.compile(fn, ins)
    got, want = p(*ins), fn(*ins)
    assert got.shape == want.shape and torch.equal(got, want)


def test_an_empty_dim_list_is_not_lowered_as_every_dim():
    """torch.all(x, dim=()) reduces nothing; the handlers refuse it rather than reduce all."""
    from tilefuse.frontend.aten import Unsupported, _dim_keep

    class B:
        def type(self, x):
            return type("T", (), {"shape": (4, 6)})()

    with pytest.raises(Unsupported):
        _dim_keep(B(), ("x", ()), {}, "x")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_a_slice_picked_per_row_of_a_larger_table_builds_and_reads_in_vector_loads(arch):
    """Falcon's fused qkv: x.view(B, S, G, H + 2, D)[:, :, :, [-2]], a gathered head per (b, s, g)
    row. The table row's base depends on the row and on the index's value, so it is read where
    it is used, after the index is computed (staged before it, with the row's other streams,
    the source named a value not yet defined: the GPU suite's Falcon failed so). Its rows of 64
    are a short map's: 8-byte chunks (mapreduce._short_map_schedule)."""
    x = torch.randn(2, 64, 2 * 8 * 64, dtype=torch.bfloat16)
    fn = lambda x: (x.view(2, 64, 2, 8, 64)[:, :, :, [-2]] * 2, x.view(2, 64, 2, 8, 64)[:, :, :, [-1]])  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    for got, want in zip(p(x), fn(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    (lw,) = p.kernels.values()
    src, cubin = compile_source_only(lw.kernel, arch)
    assert not (cubin.info.spill_stores or cubin.info.spill_loads), cubin.info
    table = [line for line in src.source.splitlines() if "< 8ULL" in line]
    assert table and all("tf_ld8(" in line or "tf_ld16(" in line for line in table), table
