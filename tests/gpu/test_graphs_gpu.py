"""CUDA-graph replay of compiled programs on the GPU (runtime/graphs.py).

Properties: a replay computes exactly what the thin launch path computes (same kernels,
bit for bit), on fresh inputs every call; externs are captured too; results the caller
holds are never overwritten by later calls; the same input storages are read in place; the
replay runs on the caller's current stream, and a slot last replayed on another stream is not
reused before that stream's queued work; the switches turn graphs off; and a call costs less
host time with graphs than without.
"""
import collections
import os
import random

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.analyze.bench import host_us
from tilefuse.check import compare, flatten, float64_reference

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


class RMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class AddRMSNorm(RMSNorm):
    def forward(self, x, res):
        h = x + res
        return h, F.rms_norm(h, (h.shape[-1],), self.weight, 1e-6)


def _softmax(x):
    return torch.softmax(x, -1)


def _xent(x, t):
    return F.cross_entropy(x, t)


def _layernorm(x):
    return F.layer_norm(x, (x.shape[-1],))


def _cases(rows, cols, dtype=BF16):
    x = lambda: torch.randn(rows, cols, device="cuda", dtype=dtype)
    t = lambda: torch.randint(0, cols, (rows,), device="cuda")
    return [
        ("rmsnorm", RMSNorm(cols).cuda().to(dtype), lambda: (x(),)),
        ("add_rmsnorm", AddRMSNorm(cols).cuda().to(dtype), lambda: (x(), x())),
        ("softmax", _softmax, lambda: (x(),)),
        ("layernorm", _layernorm, lambda: (x(),)),
        ("cross_entropy", _xent, lambda: (x(), t())),
    ]


def _pair(fn, example):
    """The same program twice: with graphs, and on the thin path."""
    on = tilefuse.compile(fn, example)
    off = tilefuse.compile(fn, example)
    on.graphs, off.graphs = True, False
    return on, off


@pytest.mark.parametrize("shape", [(257, 4096), (33, 1000), (16, 65536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_replays_equal_the_thin_path_bit_for_bit(shape):
    """Fresh inputs each call; the graph's outputs equal the thin path's exactly; replays happened."""
    for name, fn, make in _cases(*shape):
        on, off = _pair(fn, make())
        for _ in range(4):
            inputs = make()
            got, want = flatten(on(*inputs)), flatten(off(*inputs))
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g, w), f"{name}[{i}] {shape}: replay differs from the thin path"
            del got, want, g, w  # results dropped: the next call may replay the same slot
        (info,) = on.graph_info()
        assert info["graphs"] and info["replays"] == 3 and info["captures"] == 1, (name, info)


def test_externs_are_captured_with_the_kernels():
    """A matmul extern feeding an RMSNorm kernel: replays pass the 2x rule on fresh inputs."""
    w = torch.randn(512, 1024, device="cuda", dtype=BF16)

    def fn(x, w):
        return F.rms_norm(x @ w, (1024,), eps=1e-6)

    prog = tilefuse.compile(fn, (torch.randn(64, 512, device="cuda", dtype=BF16), w))
    for _ in range(4):
        x = torch.randn(64, 512, device="cuda", dtype=BF16)
        c = compare("rms(x@w)", prog(x, w), float64_reference(fn, (x, w)), fn(x, w))
        assert c.ok, c
    (info,) = prog.graph_info()
    assert info["graphs"] and info["replays"] >= 2, info


def test_results_the_caller_holds_are_never_overwritten():
    m = AddRMSNorm(4096).cuda().to(BF16)
    make = lambda: (torch.randn(128, 4096, device="cuda", dtype=BF16), torch.randn(128, 4096, device="cuda", dtype=BF16))
    on, off = _pair(m, make())
    kept = []
    for _ in range(6):
        inputs = make()
        kept.append((on(*inputs), [t.clone() for t in off(*inputs)]))
    torch.cuda.synchronize()
    for got, want in kept:
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    (info,) = on.graph_info()
    assert info["captures"] == on.graph_slots and info["thin"] >= 1, info


def test_a_rebinding_loop_keeps_replaying():
    m = RMSNorm(4096).cuda().to(BF16)
    on, off = _pair(m, (torch.randn(256, 4096, device="cuda", dtype=BF16),))
    y = None
    for _ in range(8):
        x = torch.randn(256, 4096, device="cuda", dtype=BF16)
        y = on(x)
        assert torch.equal(y, off(x))
    (info,) = on.graph_info()
    assert info["thin"] == 0 and info["replays"] == 7, info


def test_the_same_input_storages_are_read_in_place():
    m = RMSNorm(4096).cuda().to(BF16)
    x = torch.randn(256, 4096, device="cuda", dtype=BF16)
    on, off = _pair(m, (x,))
    for _ in range(5):
        x.normal_()
        assert torch.equal(on(x), off(x))
    (info,) = on.graph_info()
    assert info["captures"] == 1 and info["copies"] == 0 and info["replays"] == 4, info


def test_forget_graphs_reads_inputs_in_place_again():
    """Calls on copies of x mark it as moving (later captures copy it in); after forget_graphs,
    calls on one x capture it in place: no copies (what `tilefuse run --bench` times)."""
    m = RMSNorm(4096).cuda().to(BF16)
    x = torch.randn(256, 4096, device="cuda", dtype=BF16)
    on, off = _pair(m, (x,))
    for _ in range(4):
        on(x.clone())
    for _ in range(3):
        on(x)
    (info,) = on.graph_info()
    assert info["copies"] > 0, info
    on.forget_graphs()
    for _ in range(5):
        assert torch.equal(on(x), off(x))
    (info,) = on.graph_info()
    assert info["captures"] == 1 and info["copies"] == 0 and info["replays"] == 4, info


def test_misaligned_and_strided_inputs():
    """A contiguous view at a 2-byte offset (the scalar kernel variant) and a transposed view."""
    m = RMSNorm(1024).cuda().to(BF16)
    prog = tilefuse.compile(m, (torch.randn(64, 1024, device="cuda", dtype=BF16),))
    flat = torch.randn(64 * 1024 + 1, device="cuda", dtype=BF16)
    odd = flat[1:].view(64, 1024)
    strided = torch.randn(1024, 64, device="cuda", dtype=BF16).t()
    for x in (odd, odd, odd, strided, strided, strided):
        c = compare("rmsnorm", prog(x), float64_reference(m, (x,)), m(x))
        assert c.ok, c


def test_replays_run_on_the_callers_stream():
    """Inputs produced by slow work on a side stream are read only after it (stream order)."""
    m = RMSNorm(4096).cuda().to(BF16)
    on, off = _pair(m, (torch.randn(512, 4096, device="cuda", dtype=BF16),))
    big = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    s = torch.cuda.Stream()
    for _ in range(4):
        with torch.cuda.stream(s):
            x = (big @ big)[:512, :4096].contiguous() / 8192  # slow producer on s
            y = on(x)
            ref = off(x)
        s.synchronize()
        assert torch.equal(y, ref)


def test_a_slot_moved_to_another_stream_waits_for_the_readers_on_the_first():
    """Call on stream a, a slow reader of the result queued on a, result dropped; the next call on
    stream b (no wait between them) reuses the slot: the reader must still see the first result."""
    m = RMSNorm(4096).cuda().to(BF16)
    on, off = _pair(m, (torch.randn(256, 4096, device="cuda", dtype=BF16),))
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(2):
        on(torch.randn(256, 4096, device="cuda", dtype=BF16))  # warm-up, then capture; nothing held
    torch.cuda.synchronize()
    for _ in range(3):
        with torch.cuda.stream(a):
            x1 = torch.randn(256, 4096, device="cuda", dtype=BF16)
            y = on(x1)
            torch.cuda._sleep(2_000_000)  # about a millisecond before the reader runs
            seen = y.clone()
            del y
        with torch.cuda.stream(b):
            x2 = torch.randn(256, 4096, device="cuda", dtype=BF16)
            y2 = on(x2)
        torch.cuda.synchronize()
        assert torch.equal(seen, off(x1)), "a replay on another stream overwrote a result still being read"
        assert torch.equal(y2, off(x2))
        del y2
    (info,) = on.graph_info()
    assert info["stream_waits"] >= 3, info  # each call after the first switches streams


def _stress(dtype, calls, seed, n_streams=2):
    rng = random.Random(seed)
    streams = [torch.cuda.current_stream()] + [torch.cuda.Stream() for _ in range(n_streams - 1)]
    for name, fn, make in _cases(33, 1000, dtype)[:3]:  # rmsnorm, add_rmsnorm, softmax
        on, off = _pair(fn, make())
        held, record = collections.deque(), []
        for _ in range(calls):
            with torch.cuda.stream(rng.choice(streams)):
                inputs = make()
                outs = flatten(on(*inputs))
                want = flatten(off(*inputs))
                if rng.random() < 0.5:
                    torch.cuda._sleep(rng.randrange(1_000, 200_000))  # a slow reader of this result
                # inputs kept until the end: a new call's inputs never reuse the last call's addresses,
                # so every slot is a copy slot (the mode of issue 2's test) and replays stay frequent
                record.append(([o.clone() for o in outs], want, inputs))
            held.append(outs)
            keep = rng.randrange(3)
            while len(held) > keep:
                held.popleft()
            del outs, inputs
        torch.cuda.synchronize()
        for call, (got, want, _) in enumerate(record):
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g, w), f"{name}[{i}] {dtype}, call {call}: replay differs from the thin path"
        (info,) = on.graph_info()
        assert info["replays"] >= calls // 4 and (info["stream_waits"] > 0) == (n_streams > 1), (name, info)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
def test_replay_stress_fresh_inputs_two_streams_results_held_and_dropped(dtype):
    """200 calls per program with fresh inputs and no host sync in between, each on one of two
    streams at random, the caller keeping 0 to 2 earlier results and reading each result after a
    random delay on its call's stream: every result equals the thin path's bit for bit. This is
    where a slot is reused while an earlier replay, or a reader of its results, is still queued."""
    _stress(dtype, 200, seed=2)


def test_clone_policy_returns_private_results():
    m = RMSNorm(4096).cuda().to(BF16)
    on, off = _pair(m, (torch.randn(64, 4096, device="cuda", dtype=BF16),))
    on.graph_clone = True  # read when the first call builds the entry
    kept = [(on(x), off(x)) for x in [torch.randn(64, 4096, device="cuda", dtype=BF16) for _ in range(4)]]
    assert len({y.data_ptr() for y, _ in kept}) == 4
    assert all(torch.equal(y, r) for y, r in kept)
    (info,) = on.graph_info()
    assert info["captures"] == 1 and info["thin"] == 0, info


def test_switches_turn_graphs_off(monkeypatch):
    m = RMSNorm(1024).cuda().to(BF16)
    x = torch.randn(8, 1024, device="cuda", dtype=BF16)
    monkeypatch.setenv("TILEFUSE_CUDA_GRAPHS", "0")
    prog = tilefuse.compile(m, (x,))
    for _ in range(3):
        prog(x)
    assert prog.graphs is False and prog.graph_info() == []
    monkeypatch.delenv("TILEFUSE_CUDA_GRAPHS")
    prog = tilefuse.compile(m, (x,))
    prog.graphs = False
    for _ in range(3):
        prog(x)
    assert prog.graph_info() == []


def test_graphs_cut_the_host_time_per_call():
    """Host time of one call with the GPU idle: replaying a three-kernel program beats launching it."""
    rows, cols = 4096, 256
    x = torch.randn(rows, cols, device="cuda", dtype=BF16)
    t = torch.randint(0, cols, (rows,), device="cuda")
    on, off = _pair(_xent, (x, t))
    assert len(on.stages.kernels) >= 2
    g, thin = host_us(lambda: on(x, t), reps=60), host_us(lambda: off(x, t), reps=60)
    print(f"\nhost us/call, cross_entropy {rows}x{cols}: graphs {g:.1f}, thin {thin:.1f} "
          f"({os.environ.get('CUDA_VISIBLE_DEVICES', '')})")
    assert g < thin


def test_graph_memory_counts_each_capture_and_stops_captures_at_the_limit(monkeypatch):
    """A capture's bytes (its copied inputs and its pool, which holds the outputs) are counted
    against the process's limit; at the limit a new program runs thin with the same results and
    a warning; a dropped program gives its bytes back."""
    import gc

    from tilefuse.runtime import graphs

    memory = graphs.GraphMemory()
    monkeypatch.setattr(graphs, "MEMORY", memory)
    m = AddRMSNorm(4096).cuda().to(BF16)
    make = lambda: (torch.randn(128, 4096, device="cuda", dtype=BF16), torch.randn(128, 4096, device="cuda", dtype=BF16))
    on, off = _pair(m, make())
    for _ in range(3):
        inputs = make()
        assert all(torch.equal(g, w) for g, w in zip(on(*inputs), off(*inputs)))
    (device,) = memory.held
    ((_, g),) = on._graphed.items()
    copied = sum(b.numel() * b.element_size() for s in g.slots for b in s.inputs if b is not None)
    outputs = 2 * 128 * 4096 * 2  # h and the norm, in the graph's pool
    assert memory.held[device] >= outputs + copied, (memory.held, copied)
    memory.fixed = memory.held[device]
    on2, off2 = _pair(m, make())
    with pytest.warns(RuntimeWarning, match="without CUDA graphs"):
        for _ in range(3):
            inputs = make()
            assert all(torch.equal(g, w) for g, w in zip(on2(*inputs), off2(*inputs)))
    (info,) = on2.graph_info()
    assert info["captures"] == 0 and info["over_budget"] >= 1, info
    del on, g
    gc.collect()
    assert memory.held[device] == 0, memory.held


class _TwoProjections(torch.nn.Module):
    # narrow outputs over long K: 32 and 16 tiles of 64 columns, few enough on a 132-SM GPU that
    # one row's GEMMs take K slices (4096 x 4096 fills a wave with 64 tiles and is not sliced)
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4096, 2048, bias=False), torch.nn.Linear(2048, 1024, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_captures_split_k_gemms_share_one_workspace_that_it_keeps(monkeypatch):
    """Decode-sized GEMMs (one row; K cut in slices summed through a workspace) replay the thin
    path's bits on fresh inputs, with results held so that two slots are captured; each capture's
    GEMMs take one workspace, which the capture keeps, reserved at the largest kernel's partials
    and counters (each kernel kept its own per capture before: 2.8 GiB for an 8-layer Llama's
    decode steps). (The tile template's split-K: a program runs one-row GEMMs in the GEMV
    unless TILEFUSE_GEMV=0.)"""
    from tilefuse.codegen import gemv
    from tilefuse.runtime.gemm import GemmKernel

    monkeypatch.setenv(gemv.ENV, "0")

    m = _TwoProjections().cuda().to(BF16)
    make = lambda: (torch.randn(1, 4096, device="cuda", dtype=BF16),)
    on, off = _pair(m, make())
    held = []
    for _ in range(4):
        inputs = make()
        got, want = on(*inputs), off(*inputs)
        assert torch.equal(got, want)
        held.append(got)
    split = [k for k in on._compiled.values() if isinstance(k, GemmKernel) and k.source.workspace]
    assert len(split) >= 2, [k.source.schedule for k in on._compiled.values() if isinstance(k, GemmKernel)]
    ((_, g),) = on._graphed.items()
    assert len(g.slots) >= 2
    reserved = 4 * max(k.source.workspace for k in split) + 4 * max(k.source.flags for k in split)
    for slot in g.slots:
        assert slot.replay.workspace.nbytes() == reserved  # (reserved before the warm-up: one buffer of each kind)
