"""CUDA-graph slot policy (runtime/graphs.py), exercised on the CPU with an emulated capture.

The emulated graph behaves like a real one where it matters here: it reads the inputs it
was captured on (the caller's tensors in direct mode, private copies in copy mode) and
each replay overwrites the same output buffers. With it we check the properties the policy
promises: a result the caller still holds is never overwritten, the same input storages
are never copied, a slot is reused as soon as its results are dropped, and anything that
cannot be captured falls back to the thin path with the reason recorded.
"""
import contextlib
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F

from tilefuse.compiler import compile_stages
from tilefuse.graph import ir
from tilefuse.graph.fusion import Plan, Step
from tilefuse.runtime import graphs
from tilefuse.runtime.graphs import Graphed, GraphMemory, memory_limit


def emulated_capture(runner, tensors, direct):
    """A stand-in for capture_cuda: replay recomputes from the captured inputs into the captured
    outputs. `direct`: per input, whether the slot reads the caller's tensor or a private copy.
    The capture itself runs the program on scratch copies of the inputs it writes, as the real
    warm-up does (a capture records, it writes nothing)."""
    static = [None if d else t.clone() for t, d in zip(tensors, direct)]
    inputs = [t if s is None else s for t, s in zip(tensors, static)]
    written = set(runner.written)
    outs = runner.run([t.clone() if i in written else t for i, t in enumerate(inputs)])

    def replay():
        for o, new in zip(outs, runner.run(inputs)):
            o.copy_(new)

    return replay, outs, static, sum(o.untyped_storage().nbytes() for o in outs)


def _fn(x, w):
    h = x * 2 + 1
    return h, F.rms_norm(h, (h.shape[-1],), w, 1e-6)


def _ref(x, w):
    return [t.clone() for t in _fn(x, w)]


W = torch.randn(16)


def _graphed(fn=_fn, example=None, **kw):
    example = example or (torch.randn(4, 16), W)
    prog = compile_stages(fn, list(example)).program
    return Graphed(prog.runner("cpu"), capture=emulated_capture, **kw)


def _close(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_results_the_caller_keeps_are_never_overwritten():
    """Keeping every result: each still equals the reference for its own inputs at the end."""
    g = _graphed(max_slots=2)
    kept = []
    for _ in range(6):
        x = torch.randn(4, 16)
        kept.append((g([x, W]), _ref(x, W)))
    for got, want in kept:
        _close(got, want)
    assert g.stats["captures"] == 2 and g.stats["thin"] == 3  # two slots fill, the rest go thin


def test_a_rebinding_loop_alternates_two_slots_without_falling_back():
    """`y = prog(x)` holds the previous result during the call, so two slots serve it forever."""
    g = _graphed(max_slots=2)
    y = None
    for _ in range(8):
        x = torch.randn(4, 16)
        y = g([x, W])
        _close(y, _ref(x, W))
    assert g.stats["captures"] == 2 and g.stats["thin"] == 0 and g.stats["replays"] == 7


def test_the_same_input_storages_are_replayed_in_place_without_a_copy():
    """A caller passing the same tensors (mutated in place) gets a direct slot: no input copy, fresh values."""
    g = _graphed()
    x = torch.randn(4, 16)
    for _ in range(5):
        x.normal_()
        out = g([x, W])
        _close(out, _ref(x, W))
        del out
    assert g.stats["captures"] == 1 and g.stats["copies"] == 0 and None not in g.slots[0].ptrs


def test_new_inputs_each_call_use_one_copy_slot():
    g = _graphed()
    for _ in range(5):
        x = torch.randn(4, 16)
        _close(g([x, W]), _ref(x, W))
    # x is copied; W, at one address every call, is read where it lies
    assert g.stats["captures"] == 1 and g.slots[0].ptrs[0] is None and g.slots[0].ptrs[1] is not None
    assert g.stats["copies"] == 3 and g.stats["copied_bytes"] == 3 * 4 * 16 * 4  # x's f32 bytes, 3 replays


def test_a_direct_slot_is_not_replayed_for_other_addresses():
    g = _graphed(max_slots=2)
    x = torch.randn(4, 16)
    g([x, W])
    g([x, W])  # captured direct on x
    other = torch.randn(4, 16)
    _close(g([other, W]), _ref(other, W))
    assert len(g.slots) == 2 and g.slots[1].ptrs[0] is None and g.volatile == {0}


def test_non_contiguous_inputs_never_match_a_direct_slot():
    g = _graphed()
    base = torch.randn(16, 4)
    xt = base.t()
    for _ in range(3):
        base.normal_()
        _close(g([xt, W]), _ref(xt, W))
    assert all(s.ptrs[0] is None for s in g.slots)


@pytest.mark.parametrize("hold", ["view", "inference_view", "storage", "detached"])
def test_any_hold_on_an_output_storage_keeps_the_slot_busy(hold):
    """Views (even without a _base under inference_mode), storages and detached aliases all count."""
    g = _graphed(max_slots=1)
    g([torch.randn(4, 16), W])
    h = g([torch.randn(4, 16), W])[0]  # the other output is dropped at once
    if hold == "view":
        kept = h[1]
    elif hold == "inference_view":
        with torch.inference_mode():
            kept = h.view(-1)
    elif hold == "storage":
        kept = h.untyped_storage()
    else:
        kept = h.detach()
    del h
    assert not g.slots[0].free()
    del kept
    assert g.slots[0].free()


def test_clone_policy_reuses_one_slot_and_returns_private_copies():
    g = _graphed(clone=True)
    kept = []
    for _ in range(4):
        x = torch.randn(4, 16)
        kept.append((g([x, W]), _ref(x, W)))
    for got, want in kept:
        _close(got, want)
        assert all(t.data_ptr() != o.data_ptr() for t, o in zip(got, g.slots[0].outs))
    assert g.stats["captures"] == 1 and g.stats["thin"] == 0


def test_a_failed_capture_turns_graphs_off_with_a_warning_and_results_stay_right():
    def broken(runner, tensors, direct):
        raise RuntimeError("operation not permitted when stream is capturing")

    g = _graphed(fn=_fn)
    g.capture = broken
    g([torch.randn(4, 16), W])
    x = torch.randn(4, 16)
    with pytest.warns(RuntimeWarning, match="CUDA graphs off.*not permitted"):
        out = g([x, W])
    _close(out, _ref(x, W))
    assert g.off and "capture failed" in g.off
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _close(g([x, W]), _ref(x, W))  # later calls: quietly thin
    assert g.stats["thin"] == 1


def test_an_output_that_views_an_input_is_not_graphed():
    """A reshaped input as output would hand out the capture's input buffer: thin path instead."""
    g = _graphed(fn=lambda x: (x.reshape(8, 8), x * 2), example=(torch.randn(4, 16),))
    x = torch.randn(4, 16)
    g([x])
    y, _ = g([x])
    assert g.off and "views an input" in g.off
    assert y.data_ptr() == x.data_ptr()  # the thin path's view of the caller's own tensor, as in eager


def test_env_switch():
    assert graphs.enabled_by_env({})
    assert graphs.enabled_by_env({"TILEFUSE_CUDA_GRAPHS": "1"})
    for off in ("0", "false", "OFF", " no "):
        assert not graphs.enabled_by_env({"TILEFUSE_CUDA_GRAPHS": off})


def test_programs_read_the_env_switch_when_built_and_an_explicit_choice_wins(monkeypatch):
    monkeypatch.setenv("TILEFUSE_CUDA_GRAPHS", "0")
    st = compile_stages(_fn, [torch.randn(4, 16), W])
    assert st.program.graphs is False
    monkeypatch.setenv("TILEFUSE_CUDA_GRAPHS", "1")
    assert compile_stages(_fn, [torch.randn(4, 16), W]).program.graphs is None  # auto: by launches
    from tilefuse.runtime.program import Program

    p = st.program
    assert Program(p.graph, p.plan, p.kernels, graphs=False).graphs is False


def test_cpu_programs_report_why_they_run_without_graphs():
    p = compile_stages(_fn, [torch.randn(4, 16), W]).program
    p.graphs = True
    x = torch.randn(4, 16)
    _close(p(x, W), _ref(x, W))
    (info,) = p.graph_info()
    assert not info["graphs"] and "not a CUDA device" in info["reason"]


def test_one_launch_programs_run_without_a_graph_unless_forced():
    """The default (graphs=None) leaves a single-launch program on the thin path, with the
    reason shown; graphs=True still captures it; two launches (a kernel and an extern) do not
    count as one."""
    cuda = torch.device("cuda", 0)
    one = _extern_program("aten.cumsum.default")
    assert graphs.launches(one) == 1
    (why,) = graphs.blockers(one, cuda, auto=True)
    assert "one launch" in why and "graphs=True" in why
    assert graphs.blockers(one, cuda) == []
    two = _extern_program("aten.cumsum.default", steps=2)
    assert graphs.launches(two) == 2 and graphs.blockers(two, cuda, auto=True) == []


def test_a_histc_over_a_given_range_runs_in_a_graph_and_one_over_the_datas_range_does_not():
    """histc(x, bins, min, max) with min < max launches without a host sync (Mixtral's router);
    min == max (the default) reads the data's range back to the host first."""
    cuda = torch.device("cuda", 0)
    assert graphs.blockers(_extern_program("aten.histc.default", args=(8, 0, 7)), cuda) == []
    assert graphs.blockers(_extern_program("aten.histc.default", args=(8,), kwargs=(("min", -1.5), ("max", 2))), cuda) == []
    for args in ((8,), (8, 0, 0), (8, 3, 3)):
        (why,) = graphs.blockers(_extern_program("aten.histc.default", args=args), cuda)
        assert "aten.histc.default" in why


def _extern_program(target, steps=1, args=(), kwargs=()):
    t = ir.TensorType((4,), "f32")
    x = ir.Input("x", t)
    e = ir.Extern("e", t, target, (ir.Ref("x"),) + tuple(args), tuple(kwargs))
    g = ir.Graph((x, e), ("x",), ("e",))

    class P:
        graph = g
        plan = Plan(g, [Step(f"s{i}", "extern", ["e"]) for i in range(steps)])

    return P


def test_host_syncing_externs_block_graphs_and_ordinary_ones_do_not():
    cuda = torch.device("cuda", 0)
    assert graphs.blockers(_extern_program("aten.cumsum.default"), cuda) == []
    (why,) = graphs.blockers(_extern_program("aten.nonzero.default"), cuda)
    assert "aten.nonzero.default" in why and "host" in why


def test_a_caller_capturing_its_own_graph_gets_the_thin_path():
    """Inside someone else's capture nothing is warmed up, captured or replayed: launches go to their graph."""
    capturing = [True]
    g = _graphed()
    g.capturing = lambda: capturing[0]
    for _ in range(3):
        x = torch.randn(4, 16)
        _close(g([x, W]), _ref(x, W))
    assert g.stats["thin"] == 3 and not g.warm and not g.slots
    capturing[0] = False
    for _ in range(3):
        x = torch.randn(4, 16)
        _close(g([x, W]), _ref(x, W))
    assert g.stats["warmup"] == 1 and g.stats["captures"] == 1


class TwoStreams:
    """Fake stream bookkeeping: the test picks the current stream; each wait is logged with what
    the slot's private input buffer held at that moment (so the log shows it came before the copy)."""

    def __init__(self):
        self.now = "a"
        self.waits = []
        self.graphed = None

    def current(self):
        return self.now

    def wait(self, handle):
        inputs = [s for s in self.graphed.slots if s.stream == handle][0].inputs
        self.waits.append((self.now, handle, inputs[0].clone()))


def test_a_slot_reused_on_another_stream_first_waits_for_the_stream_of_its_last_replay():
    """Slot reuse across streams: the current stream waits for the one the slot last ran on (its
    replay and any reader of its results queued there), before the inputs are copied into it;
    reuse on the same stream never waits."""
    streams = TwoStreams()
    g = _graphed(max_slots=1, streams=streams)
    streams.graphed = g
    x = torch.randn(4, 16)
    g([x, W])
    _close(g([x.clone(), W]), _ref(x, W))  # captured on stream a, replayed there
    assert g.slots[0].stream == "a" and not streams.waits
    last_stream, prev = "a", x
    for now in ("a", "b", "b", "a", "b"):
        streams.now = now
        x = torch.randn(4, 16)
        before = len(streams.waits)
        _close(g([x, W]), _ref(x, W))
        if now == last_stream:
            assert len(streams.waits) == before, "a wait on the same stream"
        else:
            (cur, waited_for, held) = streams.waits[-1]
            assert (cur, waited_for) == (now, last_stream) and len(streams.waits) == before + 1
            assert torch.equal(held, prev), "the inputs were copied before the wait"
        assert g.slots[0].stream == now
        last_stream, prev = now, x
    assert g.stats["stream_waits"] == 3 and g.stats["captures"] == 1 and g.stats["thin"] == 0


def test_a_rebinding_loop_on_one_stream_never_waits():
    streams = TwoStreams()
    g = _graphed(max_slots=2, streams=streams)
    streams.graphed = g
    y = None
    for _ in range(8):
        x = torch.randn(4, 16)
        y = g([x, W])
        _close(y, _ref(x, W))
    assert g.stats["replays"] == 7 and not streams.waits


def _appended(cache, x):
    return torch.cat([cache, x * 2], dim=1)  # an extern cat, reshaped to its shape: a view on the thin path


def test_every_call_returns_tensors_without_a_view_base():
    """Warm-up (runner.run), capture and replay return the same kind of tensor: none is a view.
    Dynamo guards the base of a view fed back to a graph (a KV cache), so a graph traced on the
    warm-up's views failed its guards on replayed outputs and was traced again."""
    example = (torch.randn(2, 5, 4), torch.randn(2, 1, 4))
    g = _graphed(_appended, example)
    for _ in range(4):
        cache, x = torch.randn(2, 5, 4), torch.randn(2, 1, 4)
        (out,) = g([cache, x])
        assert out._base is None
        torch.testing.assert_close(out, _appended(cache, x))
    assert g.stats["captures"] >= 1


def test_a_call_leaves_no_reference_cycle_and_a_slot_stays_reusable():
    """A call's environment (its intermediate tensors) is freed when the call returns, not by
    Python's cycle collector later: a nested function in run_extern that called itself kept it
    alive, so a slot settled with those extra holders looked held once they were collected, and
    every later call captured a new slot (the GPU's third `generate` recaptured 26 of 31 sizes)."""
    example = (torch.randn(2, 5, 4), torch.randn(2, 1, 4))
    runner = compile_stages(_appended, list(example)).program.runner("cpu")
    runner.run(list(example))  # (building the runner may leave cycles once; calls may not)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable stays in gc.garbage
    try:
        for _ in range(3):
            runner.run([torch.randn(2, 5, 4), torch.randn(2, 1, 4)])
        gc.collect()
        # (this program's tensors only: what earlier tests traced, fake tensors among it, may be
        # collected now too)
        mine = {(2, 5, 4), (2, 1, 4), (2, 6, 4)}
        assert not [o for o in gc.garbage if type(o) is torch.Tensor and tuple(o.shape) in mine]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    g = _graphed(_appended, example)
    inputs = [torch.empty(2, 5, 4), torch.empty(2, 1, 4)]  # (new values, same addresses: fresh tensors
    for _ in range(6):  # might land elsewhere, and a slot then would not fit for that reason alone)
        for t in inputs:
            t.copy_(torch.randn(t.shape))
        g(list(inputs))
        gc.collect()
    assert g.stats["captures"] == 1 and g.stats["replays"] == 5, g.stats


def test_captures_stop_at_the_memory_limit_and_resume_when_slots_are_freed():
    """Slots of every Graphed of a device share one limit: once the captured ones hold it, new
    captures are skipped (those calls run thin, with eager's results, and one warning says
    why); when a Graphed holding slots is dropped, its bytes return and capturing resumes."""
    slot_bytes = 2 * 4 * 16 * 4  # a slot of _fn on (4, 16) float32: two outputs (x is copied in: + one input)
    memory = GraphMemory(limit=3 * slot_bytes)
    a = _graphed(memory=memory)
    for _ in range(3):
        x = torch.randn(4, 16)
        _close(a([x, W]), _ref(x, W))
    assert a.stats["captures"] == 1 and memory.held["cpu"] == slot_bytes + 4 * 16 * 4
    b = _graphed(memory=memory)  # (another program: its own slots, the same limit)
    with pytest.warns(RuntimeWarning, match="without CUDA graphs"):
        for _ in range(3):
            x = torch.randn(4, 16)
            _close(b([x, W]), _ref(x, W))
            c = _graphed(memory=memory)
            c([x, W])
            _close(c([x, W]), _ref(x, W))  # (its second call would capture: the limit is reached)
    assert b.stats["captures"] == 1 and memory.held["cpu"] == 2 * (slot_bytes + 4 * 16 * 4)
    assert c.stats["captures"] == 0 and c.stats["over_budget"] == 1 and c.stats["thin"] == 1
    del a, b
    gc.collect()
    assert memory.held["cpu"] == 0
    d = _graphed(memory=memory)
    for _ in range(3):
        x = torch.randn(4, 16)
        _close(d([x, W]), _ref(x, W))
    assert d.stats["captures"] == 1 and d.stats["over_budget"] == 0


def test_captures_stop_when_the_device_is_nearly_full():
    """Under an eighth of the device free (cached blocks counted as free), no new capture."""
    memory = GraphMemory(total=lambda d: 800, free=lambda d: 99)
    g = _graphed(memory=memory)
    for _ in range(3):
        x = torch.randn(4, 16)
        with pytest.warns(RuntimeWarning) if _ == 1 else contextlib.nullcontext():
            _close(g([x, W]), _ref(x, W))
    assert g.stats["captures"] == 0 and g.stats["over_budget"] == 2
    roomy = GraphMemory(total=lambda d: 800, free=lambda d: 100)
    assert roomy.room(torch.device("cpu"))


@pytest.mark.parametrize("value, want", [("0.25", 250.0), (".5", 500.0), ("1.0", 1000.0), ("8GiB", 8 << 30),
                                         ("512 MiB", 512 << 20), ("2GB", 2e9), ("123", 123.0), ("0", 0.0)])
def test_the_memory_limit_is_a_fraction_of_the_device_or_a_size(value, want):
    assert memory_limit(1000, {"TILEFUSE_GRAPH_MEMORY": value}) == want


@pytest.mark.parametrize("value", ["abc", "1.5", "-1", "8XB", "0.25GiB%"])
def test_a_bad_memory_limit_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match="TILEFUSE_GRAPH_MEMORY"):
        memory_limit(1000, {"TILEFUSE_GRAPH_MEMORY": value})


def test_the_default_memory_limit_is_a_quarter_of_the_device_and_none_without_one():
    assert memory_limit(1000, {}) == 250.0
    assert memory_limit(None, {}) == float("inf")


def test_a_bad_memory_limit_in_the_environment_warns_once_and_keeps_the_default(monkeypatch):
    """Read at a call's first capture: a typo (`8G`) must not fail the user's call."""
    monkeypatch.setenv("TILEFUSE_GRAPH_MEMORY", "8G")
    memory = GraphMemory(total=lambda d: 1000, free=lambda d: 1000)
    with pytest.warns(RuntimeWarning, match="TILEFUSE_GRAPH_MEMORY='8G'"):
        assert memory.limit(torch.device("cpu")) == 250.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert memory.limit(torch.device("cpu")) == 250.0
    g = _graphed(memory=GraphMemory())
    with pytest.warns(RuntimeWarning, match="8G"):
        for _ in range(3):
            x = torch.randn(4, 16)
            _close(g([x, W]), _ref(x, W))
    assert g.stats["captures"] == 1


def test_the_allocator_cache_is_emptied_before_a_capture_only_where_memory_is_short():
    """A capture takes new segments for its pool and cannot reclaim cached blocks meanwhile: with
    under a quarter of the device free to the driver the cache is emptied first; otherwise not
    (emptying costs a device sync and frees every cached segment, each capture)."""
    from tilefuse.runtime import graphs

    emptied = []
    gib = 1 << 30
    assert not graphs.release_if_tight("cuda:0", info=lambda d: (40 * gib, 80 * gib), empty=lambda: emptied.append(1))
    assert emptied == []
    assert graphs.release_if_tight("cuda:0", info=lambda d: (10 * gib, 80 * gib), empty=lambda: emptied.append(1))
    assert emptied == [1]


def test_only_the_first_call_at_a_size_runs_as_a_one_off():
    """graphs.FIRST_CALL is set while the warm-up call runs (attention then builds no per-shape
    plan: program._planless_attention) and never in a capture's run or a replay."""
    seen = []

    class Spy:
        def __init__(self, runner):
            self.runner, self.written, self.device = runner, runner.written, runner.device

        def run(self, tensors):
            seen.append(graphs.FIRST_CALL.get())
            return self.runner.run(tensors)

    prog = compile_stages(_fn, [torch.randn(4, 16), W]).program
    g = Graphed(Spy(prog.runner("cpu")), capture=emulated_capture, max_slots=2)
    x = torch.randn(4, 16)
    for _ in range(4):
        _close(g([x, W]), _ref(x, W))
    # warm-up, the capture's run, then replays (each replay runs the program in the emulation)
    assert seen[0] is True and not any(seen[1:]) and len(seen) >= 4
    assert graphs.FIRST_CALL.get() is False


def test_a_mask_keeps_a_key_only_where_every_query_row_has_one():
    """program._keeps_a_key: a bool mask's True or a float mask's value above -inf (a large
    finite negative, as transformers writes, still keeps its key) in every query row, over any
    broadcast shape; one row of none, or no keys at all, is not."""
    from tilefuse.runtime.program import _keeps_a_key

    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert _keeps_a_key(causal) and _keeps_a_key(causal[None, None].expand(2, 3, 5, 5))
    lo = torch.finfo(torch.bfloat16).min
    assert _keeps_a_key(torch.zeros(5, 5, dtype=torch.bfloat16).masked_fill(~causal, lo))
    additive = torch.zeros(2, 1, 5, 5).masked_fill(~causal, float("-inf"))
    assert _keeps_a_key(additive)
    additive[1, 0, 3] = float("-inf")
    assert not _keeps_a_key(additive)
    blocked = causal.clone()
    blocked[0, 0] = False
    assert not _keeps_a_key(blocked)
    assert not _keeps_a_key(torch.ones(4, 0, dtype=torch.bool))


def test_planless_attention_keeps_pytorchs_backend_switches():
    """program._planless_attention uses only the backends the process has enabled, and leaves
    PyTorch's (process-wide) switches as it found them; inputs neither planless backend takes
    (CPU tensors here) get None: the caller runs the default."""
    from tilefuse.runtime import program

    cuda = torch.backends.cuda
    switches = (cuda.flash_sdp_enabled, cuda.mem_efficient_sdp_enabled, cuda.math_sdp_enabled, cuda.cudnn_sdp_enabled)
    before = [f() for f in switches]
    q = torch.randn(1, 2, 5, 8)
    kw = dict(attn_mask=None, is_causal=True, scale=None, enable_gqa=False)
    try:
        assert program._planless_attention((q, q, q), kw) is None
        assert [f() for f in switches] == before
        cuda.enable_flash_sdp(False)
        cuda.enable_mem_efficient_sdp(False)
        assert program._planless_attention((q, q, q), kw) is None
        assert not cuda.flash_sdp_enabled() and not cuda.mem_efficient_sdp_enabled()
    finally:
        cuda.enable_flash_sdp(before[0])
        cuda.enable_mem_efficient_sdp(before[1])


def test_a_kept_input_replaced_after_a_settled_stay_is_read_in_place_at_its_new_address():
    """A buffer the caller keeps for many calls and then replaces (each `generate` makes a new
    static KV cache) gets a slot captured on it where it now lies, the stale slot evicted: it is
    never copied. Copied, every layer's cache went into the slot and back out on every step of
    every later generate."""
    g = _graphed(max_slots=2)
    kept = []  # (every x stays alive, so each lies at a new address)
    for _ in range(3):
        x = torch.randn(4, 16)
        kept.append(x)
        for _ in range(graphs.SETTLED + 2):
            x.normal_()
            out = g([x, W])
            _close(out, _ref(x, W))
            del out
    assert g.stats["copies"] == 0 and g.volatile == set(), g.stats
    assert g.stats["captures"] == 3 and g.stats["evictions"] == 1 and g.stats["thin"] == 0, g.stats
    assert {s.ptrs[0] for s in g.slots} == {kept[1].data_ptr(), kept[2].data_ptr()}


def test_an_input_moved_after_a_short_stay_is_copied_from_then_on():
    """Fewer than SETTLED calls at one address is a tensor made fresh per call that happened to
    land where the last one was: copied in every later capture, so moves cost no captures."""
    g = _graphed(max_slots=2)
    kept = []
    for _ in range(4):
        x = torch.randn(4, 16)
        kept.append(x)
        for _ in range(graphs.SETTLED - 2):
            x.normal_()
            out = g([x, W])
            _close(out, _ref(x, W))
            del out
    assert g.volatile == {0} and g.stats["captures"] == 2 and g.stats["thin"] == 0, g.stats


def _step(cache, x):
    cache.add_(x)  # written in place, as a static cache's index_copy_ is
    return cache * 2


def test_a_replaced_buffer_the_program_writes_is_written_in_place_at_its_new_address():
    """The replay writes the caller's new buffer itself: its values after each call are the
    program's, and nothing is copied in or back."""
    example = (torch.randn(3, 8), torch.randn(3, 8))
    g = _graphed(_step, example, max_slots=2)
    for _ in range(2):
        cache = torch.zeros(3, 8)
        want = torch.zeros(3, 8)
        for _ in range(graphs.SETTLED + 3):
            x = torch.randn(3, 8)
            (out,) = g([cache, x])
            want += x
            torch.testing.assert_close(cache, want)
            torch.testing.assert_close(out, want * 2)
            del out
    assert all(s.ptrs[0] is not None for s in g.slots) and g.stats["captures"] == 2, g.stats
    assert 0 not in g.volatile


def test_captures_for_moved_buffers_are_bounded_then_the_buffer_is_copied():
    """A caller swapping a kept buffer every SETTLED calls gets MOVE_CAPTURES captures for the
    moves plus one per MOVE_CALLS calls; past that the buffer is copied, and results stay right."""
    g = _graphed(max_slots=2)
    kept = []
    calls = 0
    for _ in range(12):
        x = torch.randn(4, 16)
        kept.append(x)
        for _ in range(graphs.SETTLED):
            x.normal_()
            out = g([x, W])
            _close(out, _ref(x, W))
            del out
            calls += 1
    assert g.move_captures <= graphs.MOVE_CAPTURES + calls // graphs.MOVE_CALLS, g.stats
    assert g.volatile == {0} and g.stats["captures"] <= 1 + g.move_captures + 1, (g.stats, g.move_captures)


def test_copied_bytes_count_a_written_input_in_and_back_out():
    """A fresh cache each call is copied into the slot and, being written, back out: the stats
    count its bytes twice and the step input's once, per replay that copies (the capture's own
    call fills the slot's buffers as it captures)."""
    example = (torch.randn(3, 8), torch.randn(3, 8))
    g = _graphed(_step, example, max_slots=2)
    for _ in range(4):
        cache, x = torch.zeros(3, 8), torch.randn(3, 8)
        (out,) = g([cache, x])
        torch.testing.assert_close(cache, x)
        del out
    per = 3 * 8 * 4
    assert g.stats["replays"] == 3 and g.stats["copies"] == 2, g.stats
    assert g.stats["copied_bytes"] == 2 * (2 * per + per), g.stats
