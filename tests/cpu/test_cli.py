"""The `tilefuse` command and the compiled program's input checks.

- Bad input (an expression that does not parse, one with no inputs, an op with several outputs,
  mismatched shapes): non-zero exit, exactly one stderr line `tilefuse: error: ...` naming what,
  nothing else printed, no traceback; with `-v` the exception propagates.
- `compile --ir graph|loop` and `-vv` print the stages the README promises; `run --dtype bf16`
  passes on the CPU (Loop IR interpreter) for RMSNorm, softmax, LayerNorm and cross-entropy.
- A compiled Program refuses inputs of the wrong shape, dtype or number with a ValueError naming them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.cli import main
from tilefuse.compiler import compile_stages
from tilefuse.frontend.capture import CaptureError
from tilefuse.frontend.expr import ExprError, parse

RMSNORM = "torch.nn.RMSNorm(64)(torch.randn(1, 3, 64))"


@pytest.fixture(autouse=True)
def narrow(monkeypatch):
    """An 80-column terminal: printed IR must still come out verbatim (rich must not wrap it)."""
    monkeypatch.setenv("COLUMNS", "80")


def stages_of(expr):
    m, inputs, _ = parse(expr)
    return compile_stages(m, inputs, expr=expr)


# -- bad input ---------------------------------------------------------------------------------------

BAD = [
    ("torch.randn(3, 4 +", "the expression does not parse", ExprError),
    ("1 + 2", "the expression has no inputs", ExprError),
    ("torch.randn(3, 4).nonzero()", "aten.nonzero's result has a size that depends on the tensors' values",
     CaptureError),
    ("torch.randn(3, 4) + torch.randn(5, 6)", "torch.export could not capture", CaptureError),
    # torch.export lets these two through; PyTorch refuses them when run, and so must tilefuse
    ("torch.randn(3, 4).softmax(dim=5)", "aten.softmax: dim 5 is out of range for a 2-d tensor", CaptureError),
    ("torch.randint(0, 5, (2, 3)) @ torch.randn(3, 4)", "operands of different dtypes (i64 @ f32)", CaptureError),
    ("torch.randn(0, 3).sum(-1)", "f32[0, 3] has no elements", ValueError),
]
BAD_IDS = ["parse", "no-inputs", "data-dependent", "shapes", "dim-range", "matmul-dtypes", "zero-size"]


@pytest.mark.parametrize("command", ["compile", "run"])
@pytest.mark.parametrize("expr, what, _", BAD, ids=BAD_IDS)
def test_bad_input_is_one_error_line_and_nonzero_exit(capfd, expr, what, _, command):
    """Non-zero exit; stderr is exactly one line, `tilefuse: error: <what>`; stdout is empty."""
    rc = main([command, "-c", expr])
    out, err = capfd.readouterr()
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tilefuse: error: ") and what in lines[0], lines[0]
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("expr, _, exc", BAD, ids=BAD_IDS)
def test_verbose_lets_the_exception_propagate(expr, _, exc):
    with pytest.raises(exc):
        main(["compile", "-c", expr, "-v"])


# -- printing the stages -------------------------------------------------------------------------------


def test_compile_ir_graph_prints_the_graph_and_the_plan(capsys):
    st = stages_of(RMSNORM)
    assert main(["compile", "-c", RMSNORM, "--ir", "graph"]) == 0
    out = capsys.readouterr().out
    assert str(st.graph) in out
    assert str(st.plan) in out
    assert "plan: 1 fused kernel(s), 0 GEMM(s), 0 extern(s)" in out


def test_compile_default_stage_is_graph(capsys):
    assert main(["compile", "-c", RMSNORM]) == 0
    assert "plan: 1 fused kernel(s)" in capsys.readouterr().out


def test_compile_ir_loop_prints_each_kernels_loop_ir(capsys):
    expr = "F.cross_entropy(torch.randn(6, 100), torch.randint(0, 100, (6,)))"
    st = stages_of(expr)
    assert main(["compile", "-c", expr, "--ir", "loop"]) == 0
    out = capsys.readouterr().out
    assert len(st.kernels) >= 1
    for lk in st.kernels.values():
        assert str(lk.kernel) in out
    assert "plan:" not in out  # only the stage asked for


def test_compile_vv_prints_a_diff_for_each_rewrite_that_fired(capsys):
    expr = "torch.randn(4, 8).exp().sum()"
    st = stages_of(expr)
    assert st.fired, "this program makes a rewrite fire"
    assert main(["compile", "-c", expr, "-vv"]) == 0
    out = capsys.readouterr().out
    for f in st.fired:
        assert f"rewrite {f.rule}" in out
        removed = set(f.before.splitlines()) - set(f.after.splitlines())
        added = set(f.after.splitlines()) - set(f.before.splitlines())
        assert removed or added
        for line in removed:
            assert f"-{line}" in out
        for line in added:
            assert f"+{line}" in out
    assert str(st.graph) in out  # and then the graph stage, as by default


def test_the_rewrite_trail_holds_graphs_without_weights_and_prints_them_when_asked():
    """The trail `-vv` prints keeps each rewrite's graphs without their weights (it would hold
    every derived value), and prints a graph only when its text is asked for: the last rewrite's
    `after` is the final graph, as printed."""
    b = "dtype=torch.bfloat16"
    expr = f"nn.Linear(64, 32, bias=False, {b})(nn.RMSNorm(64, {b})(torch.randn(4, 64, {b})))"
    m, inputs, _ = parse(expr)
    st = compile_stages(m, inputs, expr=expr, arch="sm_90a")
    assert st.graph.weights and [f.rule for f in st.fired] == ["rmsnorm_into_matmul"]
    for f in st.fired:
        assert all(g.weights == {} for g in f.graphs)
        assert "before" not in f.__dict__ and "after" not in f.__dict__  # (not printed yet)
    assert st.fired[-1].after == str(st.graph)


def test_loop_ir_is_printed_verbatim_on_a_narrow_terminal(capsys, monkeypatch):
    """Lines longer than the terminal (the kernel header) are not wrapped, even with no COLUMNS set."""
    monkeypatch.delenv("COLUMNS", raising=False)
    st = stages_of(RMSNORM)
    assert main(["compile", "-c", RMSNORM, "--ir", "loop"]) == 0
    out = capsys.readouterr().out
    for lk in st.kernels.values():
        assert str(lk.kernel) in out


# -- running ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("expr", [
    "torch.nn.RMSNorm(256)(torch.randn(5, 256))",
    "F.softmax(torch.randn(7, 333), -1)",
    "nn.LayerNorm(100)(torch.randn(3, 100))",
    "F.cross_entropy(torch.randn(6, 1000), torch.randint(0, 1000, (6,)))",
    "F.cross_entropy(torch.randn(6, 77), torch.randint(0, 77, (6,)), reduction='none')",
], ids=["rmsnorm", "softmax", "layernorm", "cross_entropy", "cross_entropy_none"])
def test_run_bf16_on_cpu_passes(capsys, expr):
    """`tilefuse run -c EXPR --dtype bf16` runs through the Loop IR interpreter and every output passes."""
    assert main(["run", "-c", expr, "--dtype", "bf16", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "│ pass" in out and "FAIL" not in out
    assert "fused kernel(s)" in out


@pytest.mark.parametrize("spelling, want", [("fp16", "f16"), ("float16", "f16"), ("torch.half", "f16"),
                                             ("BF16", "bf16"), ("bfloat16", "bf16"), ("fp32", "f32"),
                                             ("float32", "f32")])
def test_dtype_takes_pytorchs_and_the_fp_spellings(spelling, want):
    """--dtype fp16 (or float16, torch.half, ...) means f16: the spelling a user types is taken,
    not refused for want of the short one."""
    from tilefuse.cli import _parser

    assert _parser().parse_args(["compile", "-c", "torch.randn(2)", "--dtype", spelling]).dtype == want


def test_dtype_refuses_an_unknown_one_with_the_choices(capsys):
    """A dtype tilefuse does not cast to is refused by argparse, naming the choices."""
    from tilefuse.cli import _parser

    with pytest.raises(SystemExit):
        _parser().parse_args(["compile", "-c", "torch.randn(2)", "--dtype", "int8"])
    assert "choose from" in capsys.readouterr().err


# -- the compiled program --------------------------------------------------------------------------------


def test_program_refuses_wrong_shape_dtype_and_count_naming_the_input():
    st = compile_stages(torch.nn.RMSNorm(16), [torch.randn(4, 16)])
    prog, name = st.program, st.graph.inputs[0]
    with pytest.raises(ValueError, match=rf"input {name}: compiled for f32\[4, 16\], got f32\[4, 17\]"):
        prog(torch.randn(4, 17))
    with pytest.raises(ValueError, match=rf"input {name}: compiled for f32\[4, 16\], got bf16\[4, 16\]"):
        prog(torch.randn(4, 16).bfloat16())
    with pytest.raises(ValueError, match="expected 1 tensor inputs, got 2"):
        prog(torch.randn(4, 16), torch.randn(4, 16))


def test_program_never_returns_the_callers_tensor():
    """x.clone() captures as x itself; the program still returns a copy, not the input object."""
    prog = compile_stages(lambda x: x.clone(), [torch.randn(5)]).program
    x = torch.randn(5)
    y = prog(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()


def test_python_api_returns_a_callable_like_the_module():
    """tilefuse.compile(module, inputs) runs (on the CPU through the interpreter) like the module."""
    m = torch.nn.LayerNorm(32)
    fast = tilefuse.compile(m, (torch.randn(3, 32),))
    x = torch.randn(3, 32)
    torch.testing.assert_close(fast(x), m(x), rtol=1e-5, atol=1e-5)
    fast = tilefuse.compile(lambda x, t: F.cross_entropy(x, t, reduction="none"),
                            (torch.randn(4, 9), torch.randint(0, 9, (4,))))
    x, t = torch.randn(4, 9), torch.randint(0, 9, (4,))
    torch.testing.assert_close(fast(x, t), F.cross_entropy(x, t, reduction="none"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_run_model_checks_a_transformers_model_through_the_backend(model, capsys):
    """`run --model` builds the random transformers model, runs it through torch.compile's tilefuse
    backend (the interpreter here), passes the 2x rule and prints what ran where."""
    pytest.importorskip("transformers")
    assert main(["run", "--model", model, "--layers", "1", "--hidden", "32", "--seq", "8", "--vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "pass" in out and "FAIL" not in out
    assert "tilefuse kernel(s)" in out and "calls: 1 through tilefuse" in out


@pytest.mark.parametrize("flags, what", [
    (["--layers", "0"], "layers must be a positive integer, got 0"),
    (["--hidden", "-64"], "hidden must be a positive integer, got -64"),
    (["--seq", "0"], "seq must be a positive integer, got 0"),
    (["--batch", "0"], "batch must be a positive integer, got 0"),
    (["--vocab", "0"], "vocab must be a positive integer, got 0"),
    (["--hidden", "50"], "hidden 50 is not a multiple of the 3 attention heads (the default for this hidden size)"),
    (["--hidden", "17"], "llama: the head width, hidden 17 / 1 head(s) (the default for this hidden size), is 17: "
                         "odd, and rotary embeddings rotate pairs"),
], ids=["layers", "hidden", "seq", "batch", "vocab", "heads", "odd-head"])
def test_run_model_refuses_nonsense_sizes_in_one_line(capfd, flags, what):
    """Sizes no model can have are one `tilefuse: error:` line naming the size, exit 1, nothing
    else printed (no transformers warnings, no dynamo traceback, no model of zero layers)."""
    rc = main(["run", "--model", "llama", "--layers", "1", "--hidden", "32", "--seq", "8", "--vocab", "64", *flags])
    out, err = capfd.readouterr()
    assert rc == 1 and out == ""
    assert err.strip().splitlines() == [f"tilefuse: error: {what}"], err


def test_run_title_names_where_it_ran(capsys):
    """The table's title keeps its bracketed `[the Loop IR interpreter (no GPU)]` (a title is rich
    markup: unescaped, the brackets were taken for a style and the words vanished)."""
    assert main(["run", "-c", "torch.randn(3, 8).relu()", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "tilefuse run: torch.randn(3, 8).relu()  [the Loop IR interpreter (no GPU)]" in out


def test_run_needs_an_expression_or_a_model(capsys):
    with pytest.raises(SystemExit):
        main(["run"])
    assert "one of the arguments -c/--expr --model is required" in capsys.readouterr().err


def test_compile_prints_the_gemm_for_the_target_architecture(capsys):
    """--ir cuda shows the TMA/wgmma kernel for sm_90a and the mma.sync one for other targets (16
    rows: more than the GEMV takes)."""
    e = "nn.Linear(64, 32, dtype=torch.bfloat16)(torch.randn(16, 64, dtype=torch.bfloat16))"
    assert main(["compile", "-c", e, "--ir", "cuda", "--arch", "sm_90a"]) == 0
    assert "wgmma" in capsys.readouterr().out
    assert main(["compile", "-c", e, "--ir", "cuda", "--arch", "sm_86"]) == 0
    out = capsys.readouterr().out
    assert "mma.sync" in out and "wgmma" not in out


def test_ir_cuda_prints_the_source_the_program_builds_once_per_build(capsys):
    """Two softmaxes equal but for their names are one build (loop.canon.named_by_structure):
    --ir cuda prints that source once, under the name it is built as, says which of the step's
    buffers each parameter is, and points the second step at the first."""
    e = "torch.softmax(torch.softmax(torch.randn(64,48) @ torch.randn(48,48), -1) @ torch.randn(48,48), -1)"
    assert main(["compile", "-c", e, "--ir", "cuda", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("// ---- tf_k")]
    assert len(heads) == 2, heads
    built = heads[0].split("built as ")[1].split(" ")[0]
    assert built.startswith("tf_max_") and "b0 = matmul, b1 = div" in heads[0]
    assert heads[1].endswith("printed above") and f"built as {built} " in heads[1]
    assert out.count('extern "C" __global__') == 1 and f"\n{built}(" in out


def _graph_of(expr):
    return compile_stages(*parse(expr)[:2], expr=expr).graph


def test_a_comprehension_builds_a_module_per_item_and_refuses_an_input_per_item(capfd):
    """nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)]) is three layers, as in Python, not one
    layer hoisted once and applied three times; a factory per item is refused in one line."""
    from tilefuse.graph import ir

    g = _graph_of("nn.Sequential(*[nn.Linear(8,8) for _ in range(3)])(torch.randn(2,8))")
    assert len([n for n in g.nodes if isinstance(n, ir.Weight)]) == 6, "three weights and three biases"
    with pytest.raises(ExprError, match="would make a new input per item"):
        parse("torch.stack([torch.randn(4) for _ in range(3)])")


def test_a_factory_in_a_lambda_is_refused_saying_to_pass_it_in():
    """A lambda runs once per call, not per item: the advice is to pass the tensor as an argument."""
    with pytest.raises(ExprError, match=r"on each call of the lambda.*pass the tensor in as an argument") as e:
        parse("(lambda x: x + torch.ones(3))(torch.randn(3))")
    assert "per item" not in str(e.value)
    m, inputs, _ = parse("(lambda x, c: x + c)(torch.randn(3), torch.ones(3))")  # the advice works
    torch.testing.assert_close(m(*inputs), inputs[0] + 1)


@pytest.mark.parametrize("expr", ["(lambda x: nn.Linear(8, 8)(x))(torch.randn(2, 8))",
                                  "sum(nn.Linear(8, 8)(x) for x in [torch.randn(2, 8)])"])
def test_a_module_built_on_every_call_is_refused_in_one_line(expr, capsys):
    """A module constructor in a lambda or comprehension the forward runs would build new
    weights each call (and its initialisation would be traced): refused, naming it."""
    assert main(["run", "-c", expr, "--device", "cpu"]) != 0
    err = capsys.readouterr().err.strip()
    assert "'nn.Linear(8, 8)' is built inside a lambda or comprehension" in err and "\n" not in err


def test_a_module_passed_into_a_lambda_or_built_by_one_once_runs(capsys):
    for expr in ["(lambda f, x: f(x))(nn.Linear(8, 8), torch.randn(2, 8))",
                 "(lambda d: nn.Linear(d, d))(8)(torch.randn(2, 8))"]:
        assert main(["run", "-c", expr, "--device", "cpu"]) == 0, expr
        assert "pass" in capsys.readouterr().out


@pytest.mark.parametrize("expr", ["(lambda x: F.relu(x))(torch.randn(4))", "(x := torch.randn(4,8)) * x.sum()",
                                  "torch.stack([F.relu(t) for t in torch.randn(3,4).unbind(0)])",
                                  "torch.randn(4,8)" + ".exp()" * 300])
def test_names_bound_inside_the_expression_and_long_chains_run(expr, capsys):
    assert main(["run", "-c", expr, "--device", "cpu"]) == 0
    assert "pass" in capsys.readouterr().out


def test_expression_modules_run_in_eval_mode_and_random_programs_are_not_called_checked(capsys):
    """nn.Dropout is the identity and BatchNorm uses its running statistics (eval mode); a program
    that draws random numbers (F.dropout defaults to training) says its outputs are not checked."""
    assert main(["run", "-c", "nn.Dropout(0.5)(nn.BatchNorm1d(8)(torch.randn(4,8)))", "--device", "cpu"]) == 0
    assert "pass" in capsys.readouterr().out
    assert main(["run", "-c", "F.dropout(torch.randn(16,8), 0.5) * 4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "not checked" in out and "aten.dropout" in out and "pass" not in out


def test_integer_outputs_equal_to_pytorchs_pass_and_others_are_held_to_the_2x_rule():
    """In bf16, x > 0.3 decides some elements otherwise than float64 does, in eager too."""
    from tilefuse.check import compare

    ref = torch.tensor([True, False, True, True])
    eager = torch.tensor([True, False, False, True])
    assert compare("o", eager.clone(), ref.double(), eager).ok
    assert compare("o", ref.clone(), ref.double(), eager).ok
    worse = torch.tensor([False, True, False, True])
    c = compare("o", worse, ref.double(), eager)
    assert not c.ok and c.error == 0.75 and c.torch_error == 0.25
    assert not compare("o", eager.clone(), ref.double(), ref.clone()).ok, "exact in PyTorch: exact here"


def test_seed_repeats_a_run_weights_included_and_is_printed(capsys):
    outs = []
    for _ in range(2):
        assert main(["run", "-c", "nn.Linear(32,24)(torch.randn(16,32))", "--device", "cpu", "--seed", "7"]) == 0
        outs.append(capsys.readouterr().out)
    errors = [next(line for line in o.splitlines() if "out0" in line) for o in outs]
    assert errors[0] == errors[1] and "seed 7 (--seed 7 repeats this run)" in outs[0]
    assert main(["run", "-c", "torch.randn(3).exp()", "--device", "cpu"]) == 0
    assert "--seed" in capsys.readouterr().out, "a run without --seed prints the seed it drew"


@pytest.mark.parametrize("argv,what", [
    (["run", "-c", "torch.randn(4)*2", "--layers", "3"], "--layers is a --model option"),
    (["compile", "-c", "torch.randn(4)*2", "--arch", "foo"], "unknown GPU architecture 'foo'"),
    (["compile", "-c", "torch.randn(4)*2", "--arch", "sm_42"], "'sm_42' is not one tilefuse builds for"),
    (["compile", "-c", "torch.randn(4)*2", "--arch", "sm_999"], "'sm_999' is not one this NVRTC builds for"),
])
def test_options_that_do_not_apply_are_refused_in_one_line(capfd, argv, what):
    assert main(argv) == 1
    err = capfd.readouterr().err
    assert what in err and err.count("\n") == 1


def test_ir_loop_of_a_program_without_generated_kernels_says_so(capsys):
    assert main(["compile", "-c", "torch.randn(4,8).logcumsumexp(-1)", "--ir", "loop"]) == 0
    assert "no generated kernels" in capsys.readouterr().out


def test_layout_output_that_cannot_be_written_is_one_error_line(capfd, tmp_path):
    assert main(["layout", "(4,8):(8,1)", "-o", str(tmp_path / "missing" / "x.svg")]) == 2
    err = capfd.readouterr().err
    assert "cannot write" in err and "Traceback" not in err


@pytest.mark.parametrize("expr", ["F.mse_loss(torch.randn(8,33), torch.randn(8,33))",
                                  "F.l1_loss(torch.randn(8,33), torch.randn(33), reduction='none')",
                                  "F.softmax(torch.randn(4,8), -1, dtype=torch.float64)",
                                  "F.log_softmax(torch.randn(4,8), -1, dtype=torch.float64)"])
def test_losses_with_broadcast_operands_and_f64_softmax_match_pytorch(expr):
    """mse/l1 start with broadcast_tensors (two outputs: now expand views); softmax(dtype=f64)
    computes in f64, as PyTorch's x.to(dtype) does (f32 was 1e-8 off, hidden by the 1e-5 floor)."""
    module, inputs, _ = parse(expr)
    prog = tilefuse.compile(module, inputs)
    with torch.no_grad():
        want = module(*inputs)
    got = prog(*inputs)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-12 if want.dtype == torch.float64 else 1e-6, atol=1e-12)


@pytest.mark.parametrize("expr", ["torch.randn(4, 8).add_(1).mul(2)", "torch.randn(3, 5).mul_(torch.randn(5)).sum(-1)"])
def test_run_judges_an_input_written_in_place_and_each_run_writes_its_own_copy(expr, capsys):
    """An expression that writes its input in place: the graph shows the write, and `run` judges
    the input after the call beside the outputs, each of the program, PyTorch and the float64
    reference given its own copy (a shared one would be written three times: errors of order 1)."""
    assert main(["compile", "-c", expr, "--ir", "graph"]) == 0
    assert "write inputs_0 <- " in capsys.readouterr().out
    assert main(["run", "-c", expr, "--device", "cpu", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "inputs_0, written" in out and "FAIL" not in out
    errors = [float(tok) for line in out.splitlines() if "│" in line for tok in line.split("│")[3:4]
              if tok.strip() and tok.strip()[0].isdigit()]
    assert errors and max(errors) < 1e-5, out


def test_vv_says_when_no_rewrite_fired(capsys):
    assert main(["compile", "-c", "torch.randn(4, 4).exp()", "-vv"]) == 0
    assert "no rewrite fired" in capsys.readouterr().out


@pytest.mark.parametrize("argv,what", [
    (["run", "-c", "torch.randn(3).exp()", "--seed", "99999999999999999999"], "a seed is 0 to 2^63 - 1"),
    (["run", "-c", "torch.randn(3).exp()", "--seed", "x"], "is not an integer"),
])
def test_a_bad_seed_is_a_usage_error_naming_it(capsys, argv, what):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and what in capsys.readouterr().err


def test_an_expression_cut_short_says_where():
    from tilefuse.frontend.expr import ExprError, parse

    with pytest.raises(ExprError, match="does not parse: .* at its end"):
        parse("torch.randn(3, 4) +")
    with pytest.raises(ExprError, match="at column 21"):
        parse("torch.randn(3, 4) + )")


def test_ir_sass_prints_what_ptxas_made(capsys):
    """--ir sass compiles each kernel as a program builds it and prints its machine code, with
    its registers and spills first: the map-reduce kernel and the GEMM (here the tensor-core
    GEMV: HMMA)."""
    from tilefuse.runtime import sass

    if not sass.available():
        pytest.skip("no nvdisasm")
    e = "torch.softmax(nn.Linear(64, 32, dtype=torch.bfloat16)(torch.randn(4, 64, dtype=torch.bfloat16)), -1)"
    assert main(["compile", "-c", e, "--ir", "sass", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert out.count("// ---- ") == 2 and out.count("bytes spilled") == 2
    assert "HMMA" in out and "ACQBULK" in out and 'extern "C"' not in out


def test_ir_sass_without_nvdisasm_is_one_clear_line(capsys, monkeypatch):
    from tilefuse.runtime import sass

    monkeypatch.setattr(sass, "nvdisasm", lambda: None)
    assert main(["compile", "-c", "torch.softmax(torch.randn(4, 64), -1)", "--ir", "sass"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nvidia-cuda-nvdisasm" in err, err
