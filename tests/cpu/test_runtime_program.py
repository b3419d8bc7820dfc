"""The thin call path of a compiled program (runtime/program.py, runtime/runner.py), on the CPU.

What is checked: a call's arguments are validated in full only for a signature not seen
before (the steady state is one tuple comparison), wrong arguments still get a clear error
naming what is wrong, results are the same as PyTorch's, outputs come back in the user's
structure, and the program never hands out the caller's tensor or its own cached values.
"""
import pytest
import torch
import torch.nn.functional as F

import tilefuse.runtime.program as program_mod
from tilefuse.check import compare, float64_reference
from tilefuse.compiler import compile_stages
from tilefuse.runtime.program import _packer
from tilefuse.runtime.runner import Runner, alias_root, cloned_outputs, signature


def _prog(fn, *inputs):
    return compile_stages(fn, list(inputs)).program


def _rms(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


def test_arguments_are_checked_in_full_only_for_an_unseen_signature(monkeypatch):
    """Repeated calls with the same (dtype, shape, device) run the detailed check once."""
    calls = []
    real = program_mod.check_inputs
    monkeypatch.setattr(program_mod, "check_inputs", lambda g, t: calls.append(1) or real(g, t))
    x, w = torch.randn(4, 16), torch.randn(16)
    p = _prog(_rms, x, w)
    for _ in range(5):
        p(torch.randn(4, 16), torch.randn(16))
    assert len(calls) == 1
    p(torch.randn(4, 16, dtype=torch.float64).float(), torch.randn(16))  # same signature again
    assert len(calls) == 1


def test_runner_is_built_once_per_device():
    x = torch.randn(3, 8)
    p = _prog(lambda a: torch.softmax(a, -1), x)
    for _ in range(3):
        p(torch.randn(3, 8))
    assert len(p._runners) == 1 and len(p._entries) == 1


def test_a_gemm_prepared_for_cuda_is_not_compiled_again_for_cuda_0(monkeypatch):
    """Program.prepare("cuda") (tilefuse.compile) and the first call (tensors on "cuda:0")
    name one GPU: each GEMM is rendered and compiled once, not once per spelling."""
    import tilefuse.runtime.gemm as gemm_mod
    import tilefuse.tune.lookup as lookup

    built = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(lookup, "tuned_gemm_schedule", lambda *a, **k: None)
    monkeypatch.setattr(gemm_mod, "compile_gemm", lambda problem, sched, arch: built.append(problem) or object())
    p = _prog(lambda a, b: (a @ b).relu(), torch.randn(64, 32, dtype=torch.bfloat16),
              torch.randn(32, 48, dtype=torch.bfloat16))
    steps = [s for s in p.plan.steps if s.family == "gemm"]
    assert steps, p.plan
    p.prepare("cuda")
    for device in ("cuda", "cuda:0", torch.device("cuda", 0)):
        for s in steps:
            p.compiled_gemm(p.gemms[s.name], device)
    assert len(built) == len(steps)


def test_prepare_compiles_for_the_callers_gpu_in_every_worker_thread(monkeypatch):
    """A thread's current CUDA device is its own (a new thread's is GPU 0): prepare("cuda") on
    GPU 1 resolves the index in the calling thread, sets it in each worker, and keys the GEMMs
    as the first call on cuda:1 will ask for them (map-reduce kernels as "cuda", as the runner does)."""
    import threading

    import tilefuse.runtime.gemm as gemm_mod
    import tilefuse.runtime.launch as launch_mod
    import tilefuse.tune.lookup as lookup

    current = threading.local()
    set_in = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "index", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: (set_in.append(i), setattr(current, "index", i)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(lookup, "tuned_gemm_schedule", lambda *a, **k: None)
    seen = []
    monkeypatch.setattr(gemm_mod, "compile_gemm", lambda problem, sched, arch: seen.append(torch.cuda.current_device()))
    monkeypatch.setattr(launch_mod, "compile_kernel", lambda kernel, arch=None, schedule=None: seen.append(torch.cuda.current_device()))
    monkeypatch.setattr(program_mod, "PREPARE_THREADS", 4)
    monkeypatch.setattr(program_mod.os, "cpu_count", lambda: 4)
    a, w1, w2 = (torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 48, dtype=torch.bfloat16),
                 torch.randn(48, 40, dtype=torch.bfloat16))
    p = _prog(lambda a, b, c: torch.softmax(torch.softmax(a @ b, -1) @ c, -1), a, w1, w2)
    current.index = 1  # the caller works on GPU 1
    p.prepare("cuda")
    assert seen and set(seen) == {1} and set(set_in) == {1}
    gemm_keys = {k[1] for k in p._compiled if k[0] in {lw.epilogue.name for lw in p.gemms.values()}}
    assert gemm_keys == {"cuda:1"}
    assert {k[1] for k in p._compiled} == {"cuda:1", "cuda"}


def test_kernels_equal_but_for_their_names_are_built_once(monkeypatch):
    """Two softmaxes of equal shapes are one kernel but for their names, as a model's layers
    repeat their norms' kernels: prepare() builds it once, under names made from what it
    computes, and both steps launch that one build."""
    import tilefuse.runtime.gemm as gemm_mod
    import tilefuse.runtime.launch as launch_mod

    built = []

    class Built:  # (weakly referable, as a CompiledKernel is: the process-wide table holds it so)
        pass

    def fake(kernel, arch=None, schedule=None):
        built.append(kernel)
        return Built()

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(gemm_mod, "compile_gemm", lambda problem, sched, arch: object())
    monkeypatch.setattr(launch_mod, "compile_kernel", fake)
    monkeypatch.setattr(program_mod, "PREPARE_THREADS", 1)
    a, w1, w2 = (torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 48, dtype=torch.bfloat16),
                 torch.randn(48, 48, dtype=torch.bfloat16))
    p = _prog(lambda a, b, c: torch.softmax(torch.softmax(a @ b, -1) @ c, -1), a, w1, w2)
    steps = [s.name for s in p.plan.steps if s.family == "mapreduce"]
    assert len(steps) == 2 and len({p.kernels[s].kernel.name for s in steps}) == 2, steps
    p.prepare("cpu")
    (kernel,) = built
    # (named from what it computes, not from either step: the softmax's cast, then its max; the
    # GEMM writes bf16 and the kernel widens it, session 59)
    assert kernel.name.startswith(("tf_cast_", "tf_max_")) and [b.name for b in kernel.params] == ["b0", "b1"]
    assert p.compiled(p.kernels[steps[0]], "cpu") is p.compiled(p.kernels[steps[1]], "cpu")


def test_prepare_compiles_every_kernel_once_across_threads_and_raises_the_first_failure(monkeypatch):
    """prepare() compiles the plan's kernels in parallel threads: each step's kernel exactly
    once, all of them kept for the first call, and a kernel that fails to compile fails
    prepare() with that kernel's error (the first in plan order)."""
    import tilefuse.runtime.gemm as gemm_mod
    import tilefuse.runtime.launch as launch_mod
    import tilefuse.tune.lookup as lookup

    built = []

    def fake(name):
        built.append(name)
        return object()

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(lookup, "tuned_gemm_schedule", lambda *a, **k: None)
    monkeypatch.setattr(gemm_mod, "compile_gemm",
                        lambda problem, sched, arch: fake((problem.out_epilogue.name, problem.n, problem.k)))
    monkeypatch.setattr(launch_mod, "compile_kernel", lambda kernel, arch=None, schedule=None: fake(kernel.name))
    monkeypatch.setattr(program_mod, "PREPARE_THREADS", 4)
    monkeypatch.setattr(program_mod.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    a, w1, w2 = (torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 48, dtype=torch.bfloat16),
                 torch.randn(48, 40, dtype=torch.bfloat16))
    p = _prog(lambda a, b, c: torch.softmax(torch.softmax(a @ b, -1) @ c, -1), a, w1, w2)
    families = [s.family for s in p.plan.steps if s.family in ("gemm", "mapreduce")]
    assert families.count("gemm") >= 2 and families.count("mapreduce") >= 1, families
    p.prepare("cuda")
    assert len(built) == len(set(built)) == len(families)
    assert len(p._compiled) == len(families)
    before = len(built)
    p.prepare("cuda")  # all compiled: nothing again
    assert len(built) == before

    def broken(problem, sched, arch):
        raise RuntimeError(f"cannot compile {problem.out_epilogue.name} {problem.n}x{problem.k}")

    monkeypatch.setattr(gemm_mod, "compile_gemm", broken)
    q = _prog(lambda a, b, c: torch.softmax(torch.softmax(a @ b, -1) @ c, -1), a, w1, w2)
    first = next(s for s in q.plan.steps if s.family == "gemm")
    fp = q.gemms[first.name].problem()
    with pytest.raises(RuntimeError, match=f"cannot compile {fp.out_epilogue.name} {fp.n}x{fp.k}$"):
        q.prepare("cuda")


@pytest.mark.parametrize("bad, message", [
    (lambda: (torch.randn(4, 16, dtype=torch.float64), torch.randn(16)), "input .*compiled for f32\\[4, 16\\], got f64"),
    (lambda: (torch.randn(4, 17), torch.randn(16)), "compiled for f32\\[4, 16\\], got f32\\[4, 17\\]"),
    (lambda: (torch.randn(4, 16),), "expected 2 tensor inputs, got 1"),
    (lambda: (torch.randn(4, 16), torch.empty(16, device="meta")), "all inputs must be on one device"),
])
def test_wrong_arguments_get_a_clear_error_even_after_a_good_call(bad, message):
    p = _prog(_rms, torch.randn(4, 16), torch.randn(16))
    p(torch.randn(4, 16), torch.randn(16))  # the steady state is in place
    with pytest.raises(ValueError, match=message):
        p(*bad())


def test_non_contiguous_inputs_give_the_same_result():
    """The program takes any strides (it makes a contiguous copy where a kernel needs one)."""
    p = _prog(lambda a: torch.softmax(a, -1) * 2, torch.randn(6, 10))
    base = torch.randn(10, 6)
    xt = base.t()
    assert not xt.is_contiguous()
    torch.testing.assert_close(p(xt), torch.softmax(xt, -1) * 2)


def test_results_match_pytorch_on_fresh_inputs_every_call():
    p = _prog(lambda a, b: (a + b, F.layer_norm(a + b, (12,))), torch.randn(5, 12), torch.randn(5, 12))
    for _ in range(3):
        a, b = torch.randn(5, 12), torch.randn(5, 12)
        h, y = p(a, b)
        torch.testing.assert_close(h, a + b)
        torch.testing.assert_close(y, F.layer_norm(a + b, (12,)), atol=1e-5, rtol=1e-5)


def test_outputs_keep_the_users_structure():
    p = _prog(lambda a: {"s": torch.softmax(a, -1), "pair": (a * 2, a + 1)}, torch.randn(2, 4))
    x = torch.randn(2, 4)
    out = p(x)
    assert set(out) == {"s", "pair"} and isinstance(out["pair"], tuple)
    torch.testing.assert_close(out["pair"][1], x + 1)


@pytest.mark.parametrize("tree", [7, (1, 2), [1, 2, 3], {"a": 1, "b": (2, 3)}, (1,), ((1, 2),)])
def test_packer_rebuilds_any_output_structure(tree):
    """The packer chosen once (plain tuple, single value, or general unflatten) equals unflatten."""
    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    pack = _packer(spec, len(leaves))
    got = pack([10 * v for v in leaves])
    want = torch.utils._pytree.tree_unflatten([10 * v for v in leaves], spec)
    assert got == want and type(got) is type(want)


def test_packer_without_a_spec_returns_one_value_or_a_tuple():
    assert _packer(None, 1)(["a"]) == "a"
    assert _packer(None, 2)(["a", "b"]) == ("a", "b")


def test_an_input_returned_as_is_comes_back_as_a_copy():
    """x.clone() captures as x; the caller must get a new tensor each call, not its own."""
    p = _prog(lambda a: (a.clone(), a * 2), torch.randn(3))
    x = torch.randn(3)
    c, _ = p(x)
    assert c is not x and c.data_ptr() != x.data_ptr()
    torch.testing.assert_close(c, x)


def test_weights_returned_through_aliases_are_copies_of_the_cached_weight():
    """An output viewing a weight must not be the program's cached weight (mutating it would change later calls)."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(2, 3))

        def forward(self, x):
            return x * 2, self.w.reshape(6)

    m = M()
    st = compile_stages(m, [torch.randn(4)])
    g, plan = st.program.graph, st.program.plan
    flags = cloned_outputs(g, plan)
    roots = [alias_root(plan, o) for o in g.outputs]
    assert [r in g.weights for r in roots] == [False, True]
    assert flags == (False, True)
    _, w1 = st.program(torch.randn(4))
    w1.fill_(0)
    _, w2 = st.program(torch.randn(4))
    torch.testing.assert_close(w2, m.w.detach().reshape(6))


def test_signature_distinguishes_dtype_shape_and_device():
    a = torch.randn(2, 3)
    assert signature([a]) == signature([torch.randn(2, 3)])
    assert signature([a]) != signature([a.double()])
    assert signature([a]) != signature([torch.randn(3, 2)])
    assert signature([a]) != signature([torch.empty(2, 3, device="meta")])


def test_runner_holds_weights_and_constants_once_per_device():
    p = _prog(_rms, torch.randn(4, 16), torch.randn(16))
    r = p.runner("cpu")
    assert r is p.runner(torch.device("cpu"))
    assert isinstance(r, Runner) and all(isinstance(t, torch.Tensor) for t in r.prefilled())


class _RecordingKernel:
    """Stands in for a CompiledKernel: records what the launch glue hands it."""

    def __init__(self):
        self.launches = []

    def launch_ptrs(self, device, ptrs):
        self.launches.append((device, list(ptrs)))


def test_launch_glue_passes_pointers_in_parameter_order_and_allocates_graph_shaped_outputs():
    """Inputs by their data pointers (a contiguous copy for strided ones), outputs fresh, poisoned when asked."""
    from tilefuse.runtime.runner import _Launch

    st = compile_stages(lambda a, b: (a + b, F.rms_norm(a + b, (8,), eps=1e-6)), [torch.randn(3, 8), torch.randn(3, 8)])
    g = st.program.graph
    (step,) = [s for s in st.plan.steps if s.family == "mapreduce"]
    lowered = st.kernels[step.name]
    slots = {name: i for i, name in enumerate(g.inputs)}

    def slot(name):
        return slots.setdefault(name, len(slots))

    ck = _RecordingKernel()
    op = _Launch(ck, lowered, g, slot, torch.device("cpu", 0), poison=True)
    a, b = torch.randn(3, 8), torch.randn(8, 3).t()
    env = [a, b] + [None] * 8
    op(env)
    (device, ptrs), = ck.launches
    assert device == 0 and len(ptrs) == len(lowered.kernel.params)
    for bnd, ptr in zip(lowered.bindings, ptrs):
        t = env[slots[bnd.tensor]]
        if lowered.kernel.buffer(bnd.buffer).role == "out":
            assert ptr == t.data_ptr() and tuple(t.shape) == g[bnd.tensor].type.shape
            assert torch.isnan(t).all()  # poisoned, and the recording kernel wrote nothing
        elif t is a:
            assert ptr == a.data_ptr()
        else:
            assert ptr != b.data_ptr()  # the strided input went through a contiguous copy


def _attention(x, wq, wk, wv):
    b, s, _ = x.shape
    q, k, v = ((x @ w.t()).view(b, s, 2, 8).transpose(1, 2) for w in (wq, wk, wv))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(b, s, 16), q


def test_head_transposes_read_only_by_attention_are_views_not_copies():
    """A permute that only SDPA reads runs as a strided view (no copy); one that is also a
    program output stays a contiguous tensor; either way the results equal PyTorch's."""
    from tilefuse.graph import ir

    ins = [torch.randn(2, 5, 16)] + [torch.randn(16, 16) for _ in range(3)]
    p = _prog(_attention, *ins)
    strided = {s.nodes[0] for s in p.plan.steps if s.view}
    permutes = [n.name for n in p.graph.nodes if isinstance(n, ir.View) and n.op == "permute"]
    readers = {n.name: [u for u in p.graph.nodes if n.name in ir.node_args(u)] for n in p.graph.nodes}
    assert len(strided) == 2  # k and v; q is also returned, so it stays contiguous
    for name in strided:
        assert all(isinstance(u, ir.Attention) for u in readers[name])
    assert set(permutes) - strided  # q's transpose and the output's transpose back are copies
    o, q = p(*ins)
    ro, rq = _attention(*ins)
    torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, rq)
    assert q.is_contiguous()


def _fused_qkv_attention(x, w):
    b, s, _ = x.shape
    q, k, v = (x @ w).split(16, dim=2)  # GPT-2's c_attn: one projection, then the split
    q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(b, s, 16)


def test_the_split_of_a_fused_qkv_projection_for_attention_is_a_view_not_a_copy():
    """The slices of a fused QKV output that only SDPA reads (through the head reshape and
    transpose) run as strided views of the projection's output, and the result equals PyTorch's."""
    from tilefuse.graph import ir

    ins = [torch.randn(2, 5, 16), torch.randn(16, 48)]
    p = _prog(_fused_qkv_attention, *ins)
    strided = {s.nodes[0] for s in p.plan.steps if s.view}
    slices = {n.name for n in p.graph.nodes if isinstance(n, ir.View) and n.op == "slice"}
    permutes = {n.name for n in p.graph.nodes if isinstance(n, ir.View) and n.op == "permute"}
    assert len(slices) == 3 and slices <= strided
    assert len(strided & permutes) == 3  # q, k and v's head transposes; the one back is a copy
    assert str(p.plan).count("strided view for attention") == 6  # --ir graph says so
    assert all(s.bytes == 0 for s in p.plan.steps if s.view)
    assert sum(getattr(op, "strided", False) for op in p.runner(torch.device("cpu")).ops) == 6
    torch.testing.assert_close(p(*ins), _fused_qkv_attention(*ins), atol=1e-5, rtol=1e-5)


def _rotate_half(q):
    h = q.shape[-1] // 2
    return q * 2 + torch.cat((-q[..., h:], q[..., :h]), -1)


def test_a_rotate_half_is_one_kernel_reading_q_twice_in_place():
    """The rotate-half RoPE's `cat((-x2, x1))`: with the neg moved onto the cat's result as a sign
    (graph/rules/cat_signs.py) the cat of q's halves in rotated order is a roll of q
    (graph/rules/cat_roll.py), which the multiply-add kernel reads where q lies: one kernel, no
    slice, cat or copy left; the result is PyTorch's, bit for bit."""
    from tilefuse.graph import ir

    q = torch.randn(2, 3, 5, 8)
    p = _prog(_rotate_half, q)
    assert not any(isinstance(n, ir.View) and n.op == "slice" for n in p.graph.nodes), p.graph
    assert [s.family for s in p.plan.steps] == ["mapreduce"], str(p.plan)
    rolls = [n.name for n in p.graph.nodes if isinstance(n, ir.View) and n.op == "roll"]
    assert len(rolls) == 1 and p.plan.steps[0].reads == {rolls[0]: p.graph.inputs[0]}
    assert "in place" in str(p.plan)
    assert torch.equal(p(q), _rotate_half(q))


def _strided_split_attention(x, w):
    b, s, _ = x.shape
    y = x @ w
    q, k, v = y[..., 0::3], y[..., 1::3], y[..., 2::3]  # interleaved columns: last-dim stride 3
    q, k, v = (t.reshape(b, s, 2, 8).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 16)


def test_a_slice_with_a_step_on_the_last_dim_is_copied_for_attention():
    """SDPA's fast kernels need a contiguous last dim: a stepped slice of it stays a copy."""
    from tilefuse.graph import ir

    ins = [torch.randn(2, 5, 16), torch.randn(16, 48)]
    p = _prog(_strided_split_attention, *ins)
    views = {s.nodes[0] for s in p.plan.steps if s.view}
    slices = {n.name for n in p.graph.nodes if isinstance(n, ir.View) and n.op == "slice"}
    assert slices and not (slices & views)
    # DESIGN.md's 2x rule: f32 attention summed in another order than eager's (a fixed 1e-5
    # bound failed about 1 run in 40 on fresh random inputs)
    c = compare("attention", p(*ins), float64_reference(_strided_split_attention, ins), _strided_split_attention(*ins))
    assert c.ok, c


# -- weights changed after compiling ------------------------------------------------------------------


def _norm_linear():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.RMSNorm(32), torch.nn.Linear(32, 16, bias=False))
    with torch.no_grad():
        m[0].weight.copy_(torch.randn(32))
    return m


def test_a_weight_updated_in_place_compiles_the_program_again():
    """RMSNorm's gamma is folded into the next matmul's weight at compile time; after an in-place
    update (an optimizer step) the program's next call equals a fresh compilation of the updated
    module, never the stale fold."""
    import tilefuse

    m, x = _norm_linear(), torch.randn(4, 32)
    fast = tilefuse.compile(m, (x,))
    assert "rmsnorm_into_matmul" in [f.rule for f in fast.stages.fired]
    before = fast(x)
    with torch.no_grad():
        m[0].weight.mul_(-3)
        m[1].weight.add_(1)
    with pytest.warns(UserWarning, match="was updated in place since compiling; compiling the program again"):
        after = fast(x)
    assert fast.stages.program is fast
    assert not torch.allclose(after, before)
    assert torch.equal(after, tilefuse.compile(m, (x,))(x))
    torch.testing.assert_close(after, m(x), rtol=1e-5, atol=1e-5)


def test_a_replaced_parameter_compiles_the_program_again():
    import tilefuse

    m, x = _norm_linear(), torch.randn(4, 32)
    fast = tilefuse.compile(m, (x,))
    fast(x)
    m[0].weight = torch.nn.Parameter(torch.randn(32))
    with pytest.warns(UserWarning, match="was replaced by another tensor"):
        torch.testing.assert_close(fast(x), m(x), rtol=1e-5, atol=1e-5)


def test_a_replaced_submodule_compiles_the_program_again():
    """Replacing a layer leaves the old layer's parameter table untouched: the guard watches the
    modules on the way to each weight too."""
    import tilefuse

    m, x = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)), torch.randn(4, 32)
    fast = tilefuse.compile(m, (x,))
    fast(x)
    with torch.no_grad():
        m[2] = torch.nn.Linear(16, 8)
        with pytest.warns(UserWarning, match="module 2 was replaced by another module"):
            torch.testing.assert_close(fast(x), m(x), rtol=1e-5, atol=1e-5)


def test_a_module_switched_to_eval_mode_compiles_the_program_again():
    """nn.Modules are made in training mode: compiled so, dropout drops; after `.eval()` the next
    call compiles again (saying why) and passes values through, as the module now does; back in
    training mode it drops again. A module with no weights is watched too."""
    import tilefuse

    for m in (torch.nn.Dropout(0.5), torch.nn.Sequential(torch.nn.Linear(4000, 4000), torch.nn.Dropout(0.5))):
        x = torch.ones(4000) if isinstance(m, torch.nn.Dropout) else torch.ones(2, 4000)
        fast = tilefuse.compile(m, (x,))
        assert 0.4 < (fast(x) == 0).float().mean() < 0.6
        m.eval()
        with pytest.warns(UserWarning, match="was switched to eval mode since compiling; compiling the program again"):
            out = fast(x)
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
        m.train()
        with pytest.warns(UserWarning, match="switched to training mode"):
            assert 0.4 < (fast(x) == 0).float().mean() < 0.6


def test_a_modal_submodule_switched_alone_is_named():
    import tilefuse

    m, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).eval(), torch.ones(3, 8)
    fast = tilefuse.compile(m, (x,))
    m[1].train()
    with pytest.warns(UserWarning, match="module 1 was switched to training mode"):
        fast(x)


def test_dict_inputs_are_matched_by_key_and_other_nestings_refused():
    """A dict built in another order is the same argument; other keys, or a tuple where the
    example had a dict, are refused by path instead of being taken in flattened order."""
    import tilefuse

    x, y = torch.randn(2, 3), torch.randn(2, 3)
    fast = tilefuse.compile(lambda d, s: d["a"] - d["b"] * s[1], ({"a": x, "b": y}, [x, y]))
    expect = x - y * y
    torch.testing.assert_close(fast({"b": y, "a": x}, [x, y]), expect)
    torch.testing.assert_close(fast({"a": x, "b": y}, (x, y)), expect)  # a tuple for a list: same items
    for args, message in [(({"p": x, "q": y}, [x, y]), r"inputs\[0\]: expected a dict with keys 'a', 'b'"),
                          (((x, y), [x, y]), r"inputs\[0\]: expected a dict"),
                          (({"a": x, "b": y}, [x]), r"inputs\[1\]: expected a list of 2 items"),
                          (({"a": x, "b": 2.0}, [x, y]), r"inputs\[0\]\['b'\]: expected a tensor")]:
        with pytest.raises(ValueError, match=message):
            fast(*args)


def test_a_plain_function_gets_no_weight_guard():
    """A function's closed-over tensors are exported as constants that share memory but not a
    version counter with them: a guard there could never fire, so none is kept (no per-call cost)."""
    import tilefuse

    lin = torch.nn.Linear(32, 8)
    assert tilefuse.compile(lambda a: lin(a), (torch.randn(4, 32),)).guard is None
    assert tilefuse.compile(lin, (torch.randn(4, 32),)).guard is not None


def test_a_call_of_the_wrong_shape_after_an_update_is_still_refused():
    """The recompilation takes the call's tensors as its examples only once they fit the program."""
    import tilefuse

    m, x = _norm_linear(), torch.randn(4, 32)
    fast = tilefuse.compile(m, (x,))
    with torch.no_grad():
        m[0].weight.add_(1)
    with pytest.raises(ValueError, match=r"compiled for f32\[4, 32\], got f32\[5, 32\]"):
        fast(torch.randn(5, 32))


def test_keyword_arguments_are_refused_saying_inputs_go_by_position():
    p = _prog(_rms, torch.randn(4, 16), torch.randn(16))
    with pytest.raises(TypeError, match="takes its inputs by position.*got keyword argument.*x, w"):
        p(x=torch.randn(4, 16), w=torch.randn(16))


class _RecordingGemm:
    """Stands in for a GemmKernel: the rendered source's parameter order, launches recorded."""

    def __init__(self, source):
        self.source, self.launches, self.calls = source, [], []

    def launch_ptrs(self, device, ptrs):
        self.launches.append((device, list(ptrs)))

    def __call__(self, a, b, prepacked=(), **tensors):
        self.calls.append((a, b, dict(tensors)))


def _gemm_op(poison=True):
    from tilefuse.codegen import gemm_sm90
    from tilefuse.runtime.runner import _Gemm

    x, w, r = (torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(64, 48, dtype=torch.bfloat16),
               torch.randn(40, 48, dtype=torch.bfloat16))
    st = compile_stages(lambda x, w, r: x @ w + r, [x, w, r])
    g = st.program.graph
    (step,) = [s for s in st.plan.steps if s.family == "gemm"]
    lowered = st.program.gemms[step.name]
    slots = {name: i for i, name in enumerate(g.inputs)}

    def slot(name):
        return slots.setdefault(name, len(slots))

    gk = _RecordingGemm(gemm_sm90.render(lowered.problem()))
    op = _Gemm(gk, lowered, g, slot, torch.device("cpu", 0), poison=poison)
    return op, gk, lowered, g, slots


def test_gemm_glue_passes_pointers_in_the_kernels_parameter_order_without_per_call_checks():
    """A, B, then the epilogue's parameters in `source.params` order, straight to launch_ptrs:
    an operand's own pointer where it is contiguous and 16-byte aligned, a copy's otherwise;
    outputs fresh, graph-shaped and poisoned."""
    op, gk, lowered, g, slots = _gemm_op()
    base = [None] * (max(slots.values()) + 1)
    spec = lowered.spec
    env = list(base)
    inputs = {}
    for b in lowered.bindings:
        if b not in lowered.outputs:
            inputs[b.tensor] = torch.randn(g[b.tensor].type.shape).to(torch.bfloat16)
    a_full = torch.randn(40 * 64 + 1).to(torch.bfloat16)
    a = a_full[1:].view(40, 64)              # 2 bytes past an aligned start: read through a copy
    bw = torch.randn(48, 64).to(torch.bfloat16).t()  # strided: read through a copy
    env[slots[spec.a]], env[slots[spec.b]] = a, bw
    for name, t in inputs.items():
        env[slots[name]] = t
    op(env)
    (device, ptrs), = gk.launches
    assert device == 0 and gk.calls == []
    assert len(ptrs) == 2 + len(gk.source.params)
    assert ptrs[0] != a.data_ptr() and ptrs[0] % 16 == 0
    assert ptrs[1] != bw.data_ptr() and ptrs[1] % 16 == 0
    by_buffer = {b.buffer: b for b in lowered.bindings}
    outs = {b.buffer for b in lowered.outputs}
    assert outs, "the epilogue writes an output"
    for name, ptr in zip(gk.source.params, ptrs[2:]):
        t = env[slots[by_buffer[name].tensor]]
        assert ptr == t.data_ptr()
        if name in outs:
            assert tuple(t.shape) == g[by_buffer[name].tensor].type.shape and torch.isnan(t.float()).all()
        else:
            assert t is inputs[by_buffer[name].tensor]  # the caller's residual, read in place


def test_gemm_glue_takes_the_checked_call_where_the_kernel_packs_a_table_each_call():
    """Tables the kernel reads column-permuted and that are not weights are permuted by the
    checked call on every call: the pointer path must not hand them over unpacked."""
    op, gk, lowered, g, slots = _gemm_op(poison=False)
    op.per_call = True
    env = [torch.zeros(g[n].type.shape).to(torch.bfloat16) if n in g.inputs else None
           for n in sorted(slots, key=slots.get)]
    op(env)
    assert gk.launches == [] and len(gk.calls) == 1


def _alias_ops(p):
    from tilefuse.runtime.runner import _Alias

    return [op for op in p.runner("cpu").ops if isinstance(op, _Alias)]


def test_reshapes_only_kernels_read_run_no_step_and_results_are_unchanged():
    """A reshape between two kernels (or between reshapes and a kernel) is read through: the
    kernel takes the source, whose elements are the reshape's in the same order."""
    from tilefuse.runtime.runner import read_through_aliases

    x = torch.randn(4, 6, 8)
    fn = lambda a: torch.softmax((a * 2).reshape(4, 48).reshape(8, 24), -1)  # noqa: E731
    p = _prog(fn, x)
    aliases = [s.nodes[0] for s in p.plan.steps if s.family == "alias"]
    assert aliases, "the plan has reshapes between its kernels"
    assert set(read_through_aliases(p.graph, p.plan)) == set(aliases)
    assert _alias_ops(p) == []
    torch.testing.assert_close(p(x), fn(x))


def test_a_reshape_that_is_a_result_or_read_by_an_extern_still_runs():
    """Kept: a reshape the program returns (the caller gets its shape) and one a PyTorch op
    reads (the op sees the tensor as the graph has it)."""
    from tilefuse.graph import ir
    from tilefuse.runtime.runner import read_through_aliases

    x = torch.randn(4, 6, 8)

    def fn(a):
        # cumsum: an extern (a reshape that keeps the last dim of a map would move onto the
        # map's argument, rules/reshape_hoist.py: this one changes it)
        return (a * 2).reshape(4, 48), torch.cumsum((a + 1).reshape(48, 4), 0)

    p = _prog(fn, x)
    g = p.graph
    extern_reads = {a for s in p.plan.steps if s.family == "extern" for a in ir.node_args(g[s.nodes[0]])}
    aliases = {s.nodes[0] for s in p.plan.steps if s.family == "alias"}
    assert aliases & set(g.results) and aliases & extern_reads, "a returned reshape and one an extern reads"
    assert not (aliases & (set(g.results) | extern_reads)) & set(read_through_aliases(g, p.plan))
    assert len(_alias_ops(p)) == len(aliases & (set(g.results) | extern_reads))
    for got, want in zip(p(x), fn(x)):
        torch.testing.assert_close(got, want)
        assert got.shape == want.shape


def test_a_reshape_of_a_written_input_is_not_read_through():
    """Of a strided input the program also writes, a reshape is a copy taken before the write:
    a kernel reading the source instead would see the new value. (Capture refuses a view taken
    before a write, so the plan is made by hand.)"""
    from tilefuse.graph import ir
    from tilefuse.graph.fusion import Plan, Step
    from tilefuse.runtime.runner import read_through_aliases

    t12, t34 = ir.TensorType((12,), "f32"), ir.TensorType((3, 4), "f32")
    nodes = (ir.Input("c", t34), ir.View("r", t12, "reshape", "c", (12,)), ir.Map("y", t12, "exp", ("r",)),
             ir.Map("c2", t34, "neg", ("c",)))
    steps = [Step("alias_r", "alias", ["r"]), Step("k_y", "mapreduce", ["y"]), Step("k_c2", "mapreduce", ["c2"])]
    written = ir.Graph(nodes, ("c",), ("y", "c2"), {}, ("c",))
    assert read_through_aliases(written, Plan(written, steps)) == {}
    unwritten = ir.Graph(nodes, ("c",), ("y", "c2"), {})
    assert read_through_aliases(unwritten, Plan(unwritten, steps)) == {"r": "c"}


def _strided_input():
    return torch.randn(3, 2, 4).permute(1, 0, 2)  # shape (2, 3, 4), not contiguous


def test_a_reshape_a_kept_reshape_reads_still_runs_on_a_strided_input():
    """Of a strided input, `a.reshape(24)` is a contiguous copy and a reshape of it views that
    copy, as in eager: an extern that reads storage (as_strided, view_as) sees the copy, and a
    returned reshape is contiguous and apart from the caller's tensor. Read through, the kept
    reshape would view the caller's tensor."""
    import warnings

    def fn(a, b):
        r1 = a.reshape(24)  # read by a kernel and by kept reshapes
        r2 = r1.reshape(2, 3, 2, 2)
        return r1 * 2, r2.as_strided((6, 4), (4, 1)) + 0, r2.view_as(b) + 0, r2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = _prog(fn, torch.randn(2, 3, 4), torch.randn(6, 4))
        x, b = _strided_input(), torch.randn(6, 4)
        want = [t.clone() for t in fn(x, b)]
        got = p(x, b)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_)
    assert got[3].is_contiguous()
    x.zero_()  # the caller reuses its tensor: the returned reshape keeps its values
    torch.testing.assert_close(got[3], want[3])


def test_an_extern_result_is_returned_without_autograd_history():
    """A compiled program has no backward: a result an extern made (cat of an input that
    requires grad) comes back detached, as a CUDA-graph replay's does, not with a grad_fn
    covering only the cat (a backward through it would give x.grad = 1 where eager gives 3)."""
    import warnings

    fn = lambda a: torch.cat([a, a * 2])  # noqa: E731  (cat: an extern; a * 2: a kernel)
    p = _prog(fn, torch.randn(4, 6))
    assert {s.family for s in p.plan.steps} == {"mapreduce", "extern"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the program's no-gradient warning)
        out = p(torch.randn(4, 6, requires_grad=True))
    assert not out.requires_grad and out.grad_fn is None
