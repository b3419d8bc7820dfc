"""Values a row kernel keeps on chip between its passes (codegen/keep.py), without a GPU.

keep.plan on hand-built passes (what is kept, from which pass, read back where; what is not);
the CUDA mapreduce.render writes for lowered chains (kept arrays written once and read back,
fewer exps, the statements a read-back value makes dead left out); every kept kernel
compiles for sm_90a and sm_80 with no spills; runtime/launch.py's `_build` renders again
recomputing the values when a kept kernel would spill. Stores a later pass would make of a
value an earlier pass computed are made by that earlier pass (keep.Moved): planned, rendered,
and built again without moving when they would spill.
"""
import functools
import re

import pytest
import torch
import torch.nn.functional as F

from tilefuse.codegen import keep, mapreduce
from tilefuse.compiler import compile_stages
from tilefuse.loop.ir import Load, Loop, Op, Store, Val, Var
from tilefuse.runtime import cache, launch, nvrtc
from tilefuse.runtime.launch import compile_source_only

ARCH = "sm_90a"
TORCH = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
R = Var("r")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Every test compiles into a cache of its session's own (never the user's)."""
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cubin"))


def _softmaxes(n):
    def fn(x):
        for _ in range(n):
            x = torch.softmax(x * 2, -1)
        return x
    return fn


def _gelu_layernorms(x):
    for _ in range(2):
        x = F.layer_norm(F.gelu(x, approximate="tanh"), (x.shape[-1],))
    return x


PROGRAMS = {
    "softmax3": _softmaxes(3), "softmax6": _softmaxes(6), "softmax": _softmaxes(1),
    "gelu_layernorm2": _gelu_layernorms,
    "rmsnorm": lambda x: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype),
}


def _add_rmsnorm(x, r):
    h = x + r
    return h, h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)


def _add_then_scale_x(x, r):
    h = x + r  # stored; the final map needs x only
    return h, x * h.float().pow(2).sum(-1, keepdim=True).to(x.dtype)


TWO_INPUTS = {"add_rmsnorm": _add_rmsnorm, "add_then_scale_x": _add_then_scale_x}


@functools.lru_cache(maxsize=None)
def lowered(name, shape=(64, 1024), dtype="bf16"):
    """The one row kernel PROGRAMS[name] (or TWO_INPUTS[name]) lowers to."""
    if name in TWO_INPUTS:
        c = compile_stages(TWO_INPUTS[name], [torch.randn(*shape, dtype=TORCH[dtype]) for _ in range(2)])
    else:
        c = compile_stages(PROGRAMS[name], [torch.randn(*shape, dtype=TORCH[dtype])])
    (k,) = [lk.kernel for lk in c.kernels.values()]
    return k


def plan_of(kernel, arch=ARCH):
    """(keep plan, recorded passes) as mapreduce.render computes them under the default schedule."""
    sch = mapreduce.default_schedule(kernel, arch)
    passes = []
    mapreduce._render(kernel, sch, arch, keep.KeepPlan(), passes, not keep.SPLIT_LSE)
    return mapreduce.keep_plan(kernel, passes), passes


def body(src):
    return src.source.split('extern "C"')[1]


def last_pass(src):  # the final map over the row
    return body(src).split("// ---- map over the row")[-1]


# ---------------------------------------------------------------- keep.plan on hand-built passes


def ld(dst, p, buf="x"):
    return Load(dst, buf, (R, Var(f"c{p}")))


def blk(p, *stmts, reads=()):
    return keep.Block(f"c{p}", tuple(stmts), tuple(reads))


def two_passes(ops, buf="x"):
    """Pass 0 reduces the chain `ops` of unary f32 ops over buf[r, c]; pass 1 recomputes it
    and stores it times the row value %s into y."""
    passes = []
    for p in range(2):
        stmts, prev = [ld(f"a{p}", p, buf)], f"a{p}"
        for i, op in enumerate(ops):
            stmts.append(Op(f"t{p}_{i}", op, (prev,), "f32"))
            prev = f"t{p}_{i}"
        tail = [Op("y1", "mul", (prev, "s"), "f32"), Store("y", (R, Var("c1")), "y1")] if p else []
        passes.append([blk(p, *stmts, *tail, reads=() if p else (prev,))])
    return passes


def test_a_costly_value_of_an_earlier_pass_is_kept():
    """exp(x) computed in pass 0 and again in pass 1 is kept: written by pass 0 as %t0_0,
    read back by pass 1 as %t1_0 (its own name there)."""
    kp = keep.plan(two_passes(("exp",)), frozenset({"y"}), {"s": "f32"})
    (k,) = kp.kept
    assert k == keep.Kept(0, "f32", (0, "t0_0"), ((1, "t1_0"),))
    assert kp.writes(0) == {"t0_0": k} and kp.reads(1) == {"t1_0": k} and kp.declared(0) == [k]
    assert kp.reads(0) == {} and kp.writes(1) == {} and k.last == 1


@pytest.mark.parametrize("ops,kept", [(("neg",), 0), (("neg", "abs"), 0), (("neg", "abs", "neg"), 1)])
def test_cheap_values_are_recomputed(ops, kept):
    """A chain of one-instruction ops is kept only from keep.MIN_COST (3) of them on."""
    assert keep.MIN_COST == 3
    assert len(keep.plan(two_passes(ops), frozenset({"y"}), {"s": "f32"}).kept) == kept


def test_a_value_computed_twice_in_one_pass_is_not_kept():
    """Two blocks of one pass (two reductions) computing the same exp keep nothing: a
    value is kept only for a later pass."""
    p0 = [blk(0, ld("a0", 0), Op("e0", "exp", ("a0",), "f32"), reads=("e0",)),
          blk(0, ld("b0", 0), Op("f0", "exp", ("b0",), "f32"), reads=("f0",))]
    p1 = [blk(1, ld("a1", 1), Op("y1", "mul", ("a1", "s"), "f32"), Store("y", (R, Var("c1")), "y1"))]
    assert keep.plan([p0, p1], frozenset({"y"})).kept == ()


def test_loads_of_outputs_never_match():
    """exp of a load of an output buffer (which the kernel stores between passes) is
    recomputed; the same tree over an input is kept."""
    assert keep.plan(two_passes(("exp",), buf="y"), frozenset({"y"})).kept == ()
    assert len(keep.plan(two_passes(("exp",), buf="x"), frozenset({"y"})).kept) == 1


def test_an_f32_widening_keeps_the_16_bit_value():
    """Where pass 1 needs cast(h, f32) of a bf16 value h pass 0 made, the bf16 h is kept
    (exact, half the registers), read back as pass 1's h."""
    passes = []
    for p in range(2):
        stmts = [ld(f"a{p}", p), Op(f"e{p}", "exp", (f"a{p}",), "f32"), Op(f"h{p}", "cast", (f"e{p}",), "bf16"),
                 Op(f"w{p}", "cast", (f"h{p}",), "f32")]
        tail = [Op("y1", "mul", ("w1", "s"), "f32"), Store("y", (R, Var("c1")), "y1")] if p else []
        passes.append([blk(p, *stmts, *tail, reads=() if p else ("w0",))])
    (k,) = keep.plan(passes, frozenset({"y"}), {"s": "f32"}).kept
    assert (k.dtype, k.producer, k.readers) == ("bf16", (0, "h0"), ((1, "h1"),))


def test_a_value_and_its_widening_read_in_one_pass_list_the_reader_once():
    """Where pass 1 needs both a bf16 value h and cast(h, f32), the kept h has one reader entry
    for pass 1 (the widening redirects to h itself)."""
    passes = []
    for p in range(2):
        stmts = [ld(f"a{p}", p), Op(f"e{p}", "exp", (f"a{p}",), "f32"), Op(f"h{p}", "cast", (f"e{p}",), "bf16"),
                 Op(f"w{p}", "cast", (f"h{p}",), "f32")]
        tail = ([Store("y", (R, Var("c1")), "h1"), Op("o1", "mul", ("w1", "s"), "f32"),
                 Store("z", (R, Var("c1")), "o1")] if p else [])
        passes.append([blk(p, *stmts, *tail, reads=() if p else ("w0",))])
    (k,) = keep.plan(passes, frozenset({"y", "z"}), {"s": "f32"}).kept
    assert (k.dtype, k.producer, k.readers) == ("bf16", (0, "h0"), ((1, "h1"),))


def test_descendants_of_a_kept_value_are_recomputed_from_it():
    """Pass 2 needs exp(x) only through gt(exp(x), s), a bool that pass 1 also computed: the
    bool is not a kept dtype, so pass 2 reads back exp(x) (kept since pass 0) and
    recomputes the comparison from it."""
    def exp_pass(p, *more, reads=()):
        return [blk(p, ld(f"a{p}", p), Op(f"e{p}", "exp", (f"a{p}",), "f32"), *more, reads=reads)]
    passes = [exp_pass(0, reads=("e0",)),
              exp_pass(1, Op("g1", "gt", ("e1", "s"), "bool"), reads=("g1",)),
              exp_pass(2, Op("g2", "gt", ("e2", "s"), "bool"), Store("m", (R, Var("c2")), "g2"))]
    kp = keep.plan(passes, frozenset({"m"}), {"s": "f32"})
    (k,) = kp.kept
    assert (k.producer, k.readers) == ((0, "e0"), ((1, "e1"), (2, "e2")))
    assert set(kp.reads(2)) == {"e2"} and kp.peak_words(lambda d: 1) == 1


def test_a_pass_with_a_nested_loop_is_refused():
    """keep.plan takes flat passes only."""
    with pytest.raises(ValueError, match="nested"):
        keep.plan([[blk(0, Loop("i", 4, (ld("a", 0),)))]])


# ---------------------------------------------------------------- rendering lowered kernels


def test_softmax_chain_keeps_each_exp_and_reads_it_back():
    """Three chained softmaxes: kept arrays are declared, each one is read back ("// kept")
    by a later pass, and the kernel computes one exp per softmax per element (recomputing
    them it computes more)."""
    k = lowered("softmax3")
    src, base = mapreduce.render(k, None, ARCH), mapreduce.render(k, None, ARCH, keep_values=False)
    declared = re.findall(r"unsigned k(\d+)\[\d+\]\[\d+\] = \{\};", src.source)
    read = re.findall(r"= tf_get_\w+\(k(\d+)\[j\], v\);  // kept$", src.source, re.M)
    written = re.findall(r"tf_put_\w+\(k(\d+)\[j\], v, \w+\);  // kept for a later pass$", src.source, re.M)
    assert src.kept == len(declared) >= 3 and base.kept == 0
    assert sorted(read) == sorted(written) == sorted(declared)  # each written once, read once
    assert "k0[" not in base.source and "// kept" not in base.source
    assert body(src).count("tf_exp_fast(") == 3 < body(base).count("tf_exp_fast(")


def test_kept_values_die_after_their_last_read():
    """Each kept value of a softmax chain is read by the pass right after the one writing
    it, so the registers kept at once do not grow with the chain: 6 softmaxes keep more
    values than 3 but hold no more at a time (at most 3 values' worth)."""
    words = {"f32": 2, "bf16": 1, "f16": 1}.get  # 16-bit halves of a register
    p3, p6 = plan_of(lowered("softmax3"))[0], plan_of(lowered("softmax6"))[0]
    assert len(p6.kept) > len(p3.kept) > 0
    for k in p3.kept + p6.kept:
        assert [q for q, _ in k.readers] == [k.producer[0] + 1], str(k)
    assert p3.peak_words(words) == p6.peak_words(words) <= 3 * words("f32")


def test_single_softmax_keeps_its_exps_for_the_final_map():
    """A softmax over a raw input: with keep.SPLIT_LSE the max and the sum of exps take two
    passes, and the sum's exp(x - max) (f32) is kept for the final map, which recomputes
    nothing but the division; without keeping, the max and sum are one online pass."""
    k = lowered("softmax")
    kp, passes = plan_of(k)
    assert keep.SPLIT_LSE and len(passes) == 3
    (kept,) = kp.kept
    producer = {s.dst: s for b in passes[1] for s in b.body}[kept.producer[1]]
    assert (producer.op, kept.dtype, [q for q, _ in kept.readers]) == ("exp", "f32", [2])
    base = mapreduce.render(k, None, ARCH, keep_values=False)
    assert ", online" in body(base) and ", online" not in body(mapreduce.render(k, None, ARCH))


@pytest.mark.parametrize("name,shape", [("rmsnorm", (64, 1024)), ("rmsnorm", (16, 4096))])
def test_nothing_kept_renders_as_without_keeping(name, shape):
    """RMSNorm recomputes only cheap values (x^2, x * scale): nothing is kept and render
    gives the very source of render(keep_values=False)."""
    k = lowered(name, shape)
    assert plan_of(k)[0].kept == ()
    src = mapreduce.render(k, None, ARCH)
    assert src.kept == 0 and src.source == mapreduce.render(k, None, ARCH, keep_values=False).source


def test_the_stream_stage_keeps_nothing():
    """Under the stream stage (a chunk loop, not unrolled) no value is kept, softmaxes included."""
    k = lowered("softmax3", (33, 4096))
    sch = mapreduce.MapReduceSchedule(threads=512, group=512, vector=8, stage="stream", unroll=2, min_blocks=2)
    src = mapreduce.render(k, sch, ARCH)
    assert src.kept == 0 and src.source == mapreduce.render(k, sch, ARCH, keep_values=False).source


def test_a_read_back_value_drops_what_only_it_needed():
    """A bf16 softmax staged in shared memory: its final map reads exp(x - max) back, so it
    loads no chunk from shared memory and computes no exp; recomputing, it does both."""
    k = lowered("softmax")
    src, base = mapreduce.render(k, None, ARCH), mapreduce.render(k, None, ARCH, keep_values=False)
    assert src.schedule.stage == "smem" and src.kept == 1
    last = last_pass(src)
    assert "tf_get_f32(k0[j], v);  // kept" in last
    assert "tf_lds16" not in last and "tf_exp_fast" not in last and "tf_get_bf16" not in last
    assert "tf_lds16" in last_pass(base) and "tf_exp_fast" in last_pass(base)


def test_16_bit_values_are_packed_only_where_the_row_is_in_shared_memory():
    """A kept bf16 value takes half a register per element under the smem stage
    (k[chunks][4] for 8 elements) and is held as f32 under the regs stage."""
    smem = mapreduce.render(lowered("softmax3", (16, 4096)), None, ARCH)
    regs = mapreduce.render(lowered("softmax3"), None, ARCH)
    assert (smem.schedule.stage, regs.schedule.stage) == ("smem", "regs")
    assert "tf_put_bf16(k1[j]" in smem.source and re.search(r"unsigned k1\[\d+\]\[4\]", smem.source)
    assert "tf_put_bf16(k" not in regs.source and re.search(r"unsigned k1\[\d+\]\[8\]", regs.source)


# ---------------------------------------------------------------- stores moved to an earlier pass


def _store_passes(index=None):
    """Pass 0 reduces exp(x[r, c]); pass 1 computes it again, stores it into h (at `index`,
    else [r, c1]) and stores it times the row value %s into y."""
    st = Store("h", index or (R, Var("c1")), "t1")
    p0 = [blk(0, ld("a0", 0), Op("t0", "exp", ("a0",), "f32"), reads=("t0",))]
    p1 = [blk(1, ld("a1", 1), Op("t1", "exp", ("a1",), "f32"), st,
              Op("y1", "mul", ("t1", "s"), "f32"), Store("y", (R, Var("c1")), "y1"))]
    return [p0, p1], st


def test_a_store_of_a_value_an_earlier_pass_made_moves_there():
    """exp(x) stored by pass 1 is stored by pass 0, which computes it first (as %t0); the
    store of exp(x) * s, a value of pass 1 only, stays."""
    passes, st = _store_passes()
    kp = keep.plan(passes, frozenset({"h", "y"}), {"s": "f32"})
    assert kp.moved == (keep.Moved(st, (0, "t0"), 1),)
    assert kp.stores_at(0) == {"t0": [st]} and kp.stores_at(1) == {}
    assert kp.moved_out(1) == {st} and kp.moved_out(0) == set()
    assert kp.kept[0].producer == (0, "t0")  # exp is also kept for pass 1's product


def test_stores_that_do_not_move():
    """A store stays in its pass where its index needs a per-element value (a scatter), where
    a pass loads its buffer (moving it would change what that load reads), or where no
    earlier pass computes its value."""
    scatter, _ = _store_passes(index=(R, Val("a1")))
    assert keep.plan(scatter, frozenset({"h", "y"}), {"s": "f32"}).moved == ()
    # pass 0 reduces exp(x) + h; pass 1 stores exp(x) into h: stored by pass 0, h's load
    # there would read it (without the check on loaded buffers this store moves)
    p0 = [blk(0, ld("a0", 0), Op("t0", "exp", ("a0",), "f32"), ld("h0", 0, "h"), Op("u0", "add", ("t0", "h0"), "f32"),
              reads=("u0",))]
    p1 = [blk(1, ld("a1", 1), Op("t1", "exp", ("a1",), "f32"), Store("h", (R, Var("c1")), "t1"))]
    assert keep.plan([p0, p1], frozenset({"h"})).moved == ()
    p0_no_h = [blk(0, ld("a0", 0), Op("t0", "exp", ("a0",), "f32"), reads=("t0",))]
    assert len(keep.plan([p0_no_h, p1], frozenset({"h"})).moved) == 1
    p0 = [blk(0, ld("a0", 0), Op("t0", "exp", ("a0",), "f32"), reads=("t0",))]
    p1 = [blk(1, ld("a1", 1), Op("u1", "tanh", ("a1",), "f32"), Store("h", (R, Var("c1")), "u1"))]
    assert keep.plan([p0, p1], frozenset({"h"})).moved == ()


def test_add_rmsnorm_stores_its_sum_in_the_pass_that_reduces_it():
    """x + res is stored by the pass summing its squares, as each chunk is made, not beside
    the normed output in the final map; one store of each output in the kernel."""
    k = lowered("add_rmsnorm")
    src = mapreduce.render(k, None, ARCH)
    assert src.schedule.stage == "smem" and (src.kept, src.moved) == (0, 1)
    first, last = body(src).split("// ---- map over the row")
    assert "stored here, where its value is made" in first
    add = [b.name for b in k.params if b.role == "out"]
    assert len(add) == 2
    stores = {n: body(src).count(f"tf_st16(g_{n} +") for n in add}
    assert sorted(stores.values()) == [1, 1], stores
    assert sum(f"tf_st16(g_{n} +" in first for n in add) == 1 and sum(f"tf_st16(g_{n} +" in last for n in add) == 1


def test_no_store_moves_where_the_row_is_in_registers():
    """Under the regs stage (the packed chunk would add to register pressure) the store stays
    in the final map."""
    k = lowered("add_rmsnorm")
    sch = mapreduce.default_schedule(k, ARCH, stage="regs")
    src = mapreduce.render(k, sch, ARCH)
    assert src.moved == 0 and src.source == mapreduce.render(k, sch, ARCH, keep_values=False).source


def test_a_moved_store_drops_what_only_it_needed():
    """h = x + res stored early; the final map computes x * sum(h^2) and reads neither res
    nor h there: one shared-memory read (x's chunk), where without moving it reads both."""
    k = lowered("add_then_scale_x")
    src, base = mapreduce.render(k, None, ARCH), mapreduce.render(k, None, ARCH, keep_values=False)
    assert src.moved == 1
    assert last_pass(src).count("tf_lds16(") == 1 and last_pass(base).count("tf_lds16(") == 2


def test_build_renders_again_without_moving_when_it_would_spill(monkeypatch):
    """_build gives up a moved store the way it gives up kept values: when ptxas spills."""
    k = lowered("add_rmsnorm")
    calls = _fake_compile(monkeypatch, lambda s: "stored here, where its value is made" in s)
    src, cubin, _ = launch._build(k, ARCH, None)
    assert len(calls) == 2 and src.moved == 0 and cubin.info.clean
    assert src.source == mapreduce.render(k, None, ARCH, keep_values=False).source


def test_build_lowers_a_spilling_default_schedules_ctas_per_sm(monkeypatch):
    """A default schedule whose kernel spills (with nothing kept or moved to give up) is built
    again with fewer CTAs an SM (min_blocks halved above 4, one fewer from 4) until ptxas reports
    none; a schedule given is built once, spills and all. (add_then_scale_x at 32768 x 256 bf16
    spilled 44 bytes on sm_90a under its default's 8 CTAs an SM; at 4 it does not.)"""
    k = lowered("rmsnorm", (32768, 256))
    sch = mapreduce.default_schedule(k, ARCH)
    assert sch.min_blocks == 8
    calls = _fake_compile(monkeypatch, lambda s: f"__launch_bounds__({sch.threads}, 8)" in s)
    src, cubin, _ = launch._build(k, ARCH, None)
    assert len(calls) == 2 and cubin.info.clean and src.schedule.min_blocks == 4
    calls = _fake_compile(monkeypatch, lambda s: True)
    src, cubin, _ = launch._build(k, ARCH, sch)
    assert len(calls) == 1 and src.schedule == sch and not cubin.info.clean
    calls = _fake_compile(monkeypatch, lambda s: True)  # never clean: 8, 4, 3, 2, 1 CTAs an SM, then given up
    src, cubin, _ = launch._build(k, ARCH, None)
    assert [src.schedule.min_blocks, len(calls)] == [1, 5] and not cubin.info.clean


def test_a_spilling_default_is_built_clean():
    """add_then_scale_x at 32768 x 256 bf16 compiles with no spills for sm_90a and sm_80."""
    k = lowered("add_then_scale_x", (32768, 256))
    for arch in ("sm_90a", "sm_80"):
        src, cubin = compile_source_only(k, arch)
        assert cubin.info.clean, (arch, src.schedule, cubin.info)


MOVING_SHAPES = {"bf16": [(64, 1024), (5, 1000), (9, 768), (3, 520)], "f16": [(64, 1024), (5, 1000), (9, 768), (3, 520)],
                 "f32": [(7, 256), (9, 512), (5, 500), (3, 264)]}


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("i", range(4))
@pytest.mark.parametrize("name", ["add_rmsnorm", "add_then_scale_x"])
def test_moved_stores_compile_without_spills(name, i, dtype):
    """Kernels whose default moves a store (rows staged in shared memory, several a CTA)
    compile for sm_90a and sm_80 with the store moved and no spills."""
    k = lowered(name, MOVING_SHAPES[dtype][i], dtype)
    for arch in ("sm_90a", "sm_80"):
        assert mapreduce.render(k, None, arch).moved == 1
        src, cubin = compile_source_only(k, arch)
        assert src.moved == 1 and cubin.info.registers > 0 and cubin.info.clean, (arch, src.schedule, cubin.info)


def test_a_stack_frame_without_spills_keeps_the_default():
    """f32 sin keeps a 32-byte stack frame under any register cap (its slow path): that is
    no spill, so the default's CTAs an SM are not cut (they were, down to one, in review)."""
    c = compile_stages(lambda x: x.sin() + 1, [torch.randn(64, 1024)])
    (k,) = [lk.kernel for lk in c.kernels.values()]
    src, cubin = compile_source_only(k, ARCH)
    assert cubin.info.spill_stores == 0 and src.schedule == mapreduce.default_schedule(k, ARCH)


# ---------------------------------------------------------------- compiling


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("shape", [(64, 1024), (16, 4096), (5, 1000), (7, 4097)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", ["softmax3", "gelu_layernorm2"])
def test_kept_kernels_compile_without_spills(name, shape, dtype):
    """Every chain keeps values and compiles for sm_90a and sm_80 with no spills and no stack
    frame; where the kernel built keeps nothing, keeping would have spilled (the fallback)."""
    k = lowered(name, shape, dtype)
    for arch in ("sm_90a", "sm_80"):
        keeping = mapreduce.render(k, None, arch)
        assert keeping.kept > 0
        src, cubin = compile_source_only(k, arch)
        assert cubin.info.registers > 0 and cubin.info.clean, (arch, src.schedule, cubin.info)
        if src.kept == 0:  # the fallback: ptxas spilled the keeping source (a cache hit now)
            spilled, hit = cache.compile_cached(keeping.source, keeping.name, arch)
            assert hit and not spilled.info.clean
        else:
            assert src.source == keeping.source


def _fake_compile(monkeypatch, spills):
    """cache.compile_cached replaced: a source spills where `spills(source)`; the sources
    compiled are returned (a list, filled as _build compiles)."""
    calls = []

    def compile_cached(source, name, arch):
        calls.append(source)
        n = 8 if spills(source) else 0
        return nvrtc.Cubin(b"", arch, nvrtc.CompileInfo(32, n, n, 0), ""), False
    monkeypatch.setattr(cache, "compile_cached", compile_cached)
    return calls


def test_build_recomputes_kept_values_that_would_spill(monkeypatch):
    """_build renders a kept kernel again without keeping when ptxas reports spills, and
    returns that one; a kept kernel that fits is compiled once."""
    k = lowered("softmax3")
    calls = _fake_compile(monkeypatch, lambda s: "(codegen/keep.py)" in s)
    src, cubin, _ = launch._build(k, ARCH, None)
    assert len(calls) == 2 and "(codegen/keep.py)" in calls[0]
    assert src.kept == 0 and "(codegen/keep.py)" not in src.source and cubin.info.clean
    assert src.source == calls[1] == mapreduce.render(k, None, ARCH, keep_values=False).source
    calls = _fake_compile(monkeypatch, lambda s: False)
    src, _, _ = launch._build(k, ARCH, None)
    assert len(calls) == 1 and src.kept > 0


def test_build_compiles_a_kernel_keeping_nothing_once(monkeypatch):
    """A kernel with nothing kept or moved, under a schedule given, is compiled once even when
    its cubin spills (there is nothing to give up; a default schedule would try fewer CTAs an
    SM, above)."""
    k = lowered("rmsnorm")
    calls = _fake_compile(monkeypatch, lambda s: True)
    src, cubin, _ = launch._build(k, ARCH, mapreduce.default_schedule(k, ARCH))
    assert len(calls) == 1 and src.kept == 0 and src.moved == 0 and not cubin.info.clean


def test_a_kept_cast_is_rounded_even_where_only_stores_use_it():
    """A cast to bf16 whose only IR uses are stores is left unrounded in C (the store rounds);
    once kept, a later pass reads it back, so it must be rounded where it is computed. The
    canonical form of this program puts the storing map (tanh(exp(x)) -> bf16) before the
    reduction that recomputes it, under the regs stage (kept as f32)."""
    from tilefuse.loop.canon import canonicalize

    def fn(x):
        y = torch.tanh(torch.exp(x))
        return y, y.float().pow(2).sum(-1)
    c = compile_stages(fn, [torch.randn(64, 1024, dtype=torch.bfloat16)])
    (k,) = [canonicalize(lk.kernel) for lk in c.kernels.values()]
    src = mapreduce.render(k, mapreduce.default_schedule(k, ARCH, stage="regs"), ARCH)
    assert src.kept and src.schedule.stage == "regs"
    put = re.search(r"tf_put_f32\(k0\[j\], v, (\w+)\);", src.source)
    assert put, "the kept value is written as f32 under the regs stage"
    (line,) = [ln for ln in src.source.splitlines() if f"const float {put.group(1)} =" in ln]
    assert "tf_round_bf16(" in line, line
