"""The 2x rule on small outputs: judged over several input draws (tilefuse.check.check_outputs).

One value (a mean loss) carries one random rounding error, and PyTorch's is sometimes near 0 by
luck; the rule on that one draw then fails a correct program. A float output of fewer than
VALUES elements is judged as the vector of its values over enough fresh draws for VALUES values,
by the same `compare`.

Properties: a correct loss whose eager error is near 0 on the run's own draw passes, in
`tilefuse run --model llama --output loss` on the seeds that used to FAIL too; a loss off by a
relative 1e-3 still fails; larger and integer outputs are judged on the run's own draw alone,
exactly as before, and cost no draw; the CLI says which outputs were judged over draws.
"""
from __future__ import annotations

import pytest
import torch

import tilefuse.check as check
from tilefuse.check import VALUES, Results, check_outputs, compare, draws_needed
from tilefuse.cli import main

LOSS = 4.85  # about log(128): a random model's loss over a vocabulary of 128
EAGER_ERR = 3e-5  # the typical relative error of a bf16 Llama's f32 loss (measured: 2e-5 to 4e-5)


def scalar_draw(gen: torch.Generator, out_err: float | None, eager_err: float | None = None) -> Results:
    """One draw of a scalar loss: the reference, PyTorch's value with a random relative error of
    EAGER_ERR's scale (or `eager_err`), the program's with `out_err` (None: random, as eager's)."""
    ref = torch.tensor(LOSS + 0.05 * torch.randn((), generator=gen).item(), dtype=torch.float64)

    def off(err):
        err = EAGER_ERR * torch.randn((), generator=gen).item() if err is None else err
        return (ref * (1 + err)).float()

    return Results([off(out_err)], [ref], [off(eager_err)])


def test_a_scalar_whose_eager_error_is_near_zero_by_luck_passes_over_draws():
    """Draw 0 is the seed-4 case of the report: compiled 4.3e-5 against eager 1.6e-6."""
    gen = torch.Generator().manual_seed(0)
    first = scalar_draw(gen, 4.3e-5, 1.6e-6)
    assert not compare("loss", first.outs[0], first.refs[0], first.torch_outs[0]).ok, "one draw fails it"
    (c,) = check_outputs(["loss"], first, lambda k: scalar_draw(gen, None))
    assert c.ok and c.draws == VALUES, c


@pytest.mark.parametrize("seed", range(5))
def test_a_scalar_off_by_a_relative_1e3_fails(seed):
    gen = torch.Generator().manual_seed(seed)
    (c,) = check_outputs(["loss"], scalar_draw(gen, 1e-3), lambda k: scalar_draw(gen, 1e-3))
    assert not c.ok and c.draws == VALUES and c.error > 10 * c.bound, c


def test_large_and_integer_outputs_are_judged_on_the_first_draw_alone_as_before():
    torch.manual_seed(0)
    ref = torch.randn(VALUES, dtype=torch.float64)
    eager, out = ref.bfloat16(), (ref * (1 + 1e-3)).bfloat16()
    ints = torch.tensor(3)

    def draw(k):
        raise AssertionError("no output needs a draw")

    first = Results([out, ints], [ref, ints], [eager, ints])
    checks = check_outputs(["x", "i"], first, draw)
    assert checks == [compare("x", out, ref, eager), compare("i", ints, ints, ints)]
    assert all(c.draws == 1 for c in checks)


def test_every_float_output_is_judged_on_at_least_values_values():
    f, i = torch.float32, torch.int64
    assert [draws_needed(torch.zeros(s, dtype=f)) for s in [(), (3,), (4,), (2, 8), (0,)]] == [VALUES, 6, 4, 1, 1]
    assert draws_needed(torch.zeros((), dtype=i)) == 1
    drawn = []

    def draw(k):
        drawn.append(k)
        return Results([torch.ones(()), torch.ones(4), torch.ones(2, 8)],
                       [torch.ones((), dtype=torch.float64), torch.ones(4).double(), torch.ones(2, 8).double()],
                       [torch.ones(()), torch.ones(4), torch.ones(2, 8)])

    checks = check_outputs(["s", "v", "m"], draw(0), draw)
    assert drawn == list(range(VALUES)), "draws 1 to VALUES - 1, for the scalar"
    assert [c.draws for c in checks] == [VALUES, VALUES, 1] and all(c.ok for c in checks)
    assert check_outputs(["s"], draw(0), None)[0].draws == 1, "no draw function: one draw"


# -- through the CLI ------------------------------------------------------------------------------

# the report's repro (notes/gpu_models_s29.md): on one draw, seeds 4, 5 and 8 FAILed a correct loss
LLAMA_LOSS = ["run", "--model", "llama", "--output", "loss", "--layers", "2", "--hidden", "64", "--seq", "16",
              "--batch", "2", "--vocab", "128", "--device", "cpu"]


@pytest.mark.usefixtures("fresh_backend")
@pytest.mark.parametrize("seed", [4, 5, 8])
def test_cli_model_loss_passes_on_the_seeds_where_one_draw_failed(seed, capsys, monkeypatch):
    pytest.importorskip("transformers")
    alone = []
    judge = check.compare_draws

    def spy(name, outs, refs, torch_outs):  # the old rule: the run's own draw alone
        alone.append(compare(name, outs[0], refs[0], torch_outs[0]))
        return judge(name, outs, refs, torch_outs)

    monkeypatch.setattr(check, "compare_draws", spy)
    assert main([*LLAMA_LOSS, "--seed", str(seed)]) == 0
    out = capsys.readouterr().out
    assert [c.ok for c in alone] == [False], alone
    assert f"pass over {VALUES} draws" in out and f"loss: checked over {VALUES} input draws" in out


@pytest.mark.usefixtures("fresh_backend")
def test_cli_model_loss_off_by_a_relative_1e3_fails(capsys, monkeypatch):
    """A wrong program: the tilefuse-compiled model's loss times 1 + 1e-3."""
    pytest.importorskip("transformers")
    real = torch.compile

    def off(model, **kw):
        compiled = real(model, **kw)
        return lambda *xs: compiled(*xs) * (1 + 1e-3)

    monkeypatch.setattr(torch, "compile", off)
    assert main([*LLAMA_LOSS, "--seed", "4"]) == 2
    assert f"FAIL over {VALUES} draws" in capsys.readouterr().out


def test_cli_expression_scalar_is_drawn_and_a_tensor_or_random_program_is_not(capsys):
    ce = "F.cross_entropy(nn.Linear(64, 100)(torch.randn(16, 64)).float(), torch.randint(0, 100, (16,)))"
    assert main(["run", "-c", ce, "--dtype", "bf16", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"pass over {VALUES} draws" in out and f"out0: checked over {VALUES} input draws" in out
    assert main(["run", "-c", "torch.randn(4, 8).exp()", "--device", "cpu"]) == 0
    assert "checked over" not in capsys.readouterr().out
    assert main(["run", "-c", "F.dropout(torch.randn(16, 8), 0.5).sum()", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "not checked" in out and "checked over" not in out


def test_cli_expression_scalar_off_by_a_relative_1e3_fails(capsys, monkeypatch):
    from tilefuse.runtime.program import Program

    real = Program.__call__
    monkeypatch.setattr(Program, "__call__", lambda self, *xs: real(self, *xs) * (1 + 1e-3))
    ce = "F.cross_entropy(nn.Linear(64, 100)(torch.randn(16, 64)).float(), torch.randint(0, 100, (16,)))"
    assert main(["run", "-c", ce, "--dtype", "bf16", "--device", "cpu", "--seed", "0"]) == 2
    assert f"FAIL over {VALUES} draws" in capsys.readouterr().out


def test_run_help_states_the_number_of_values(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert f"fewer than {VALUES} values" in " ".join(capsys.readouterr().out.split())


# -- programs that route by rounded values (a mixture of experts): draws=, combine_draws ----------


def routed_draw(gen: torch.Generator, out_flips: bool, eager_flips: bool) -> Results:
    """One draw of a (64, 32) output: rounding noise of bf16's scale everywhere, and where a
    token is routed otherwise than float64 routes it, an error of 30% of its row."""
    ref = torch.randn(64, 32, generator=gen, dtype=torch.float64)

    def run(flips):
        x = ref * (1 + 2e-3 * torch.randn(64, 32, generator=gen, dtype=torch.float64))
        if flips:
            x[int(torch.randint(64, (), generator=gen))] *= 1.3
        return x.bfloat16()

    return Results([run(out_flips)], [ref], [run(eager_flips)])


def test_combined_draws_equal_the_rule_on_the_draws_stacked():
    gen = torch.Generator().manual_seed(1)
    rs = [routed_draw(gen, k % 3 == 0, k % 2 == 0) for k in range(6)]
    per = [(compare("y", r.outs[0], r.refs[0], r.torch_outs[0]), check.ref_norm(r.refs[0])) for r in rs]
    pooled = check.combine_draws("y", *zip(*per))
    stacked = check.compare_draws("y", [r.outs[0] for r in rs], [r.refs[0] for r in rs], [r.torch_outs[0] for r in rs])
    assert pooled.draws == stacked.draws == 6 and pooled.ok == stacked.ok
    assert pooled.error == pytest.approx(stacked.error, rel=1e-9)
    assert pooled.torch_error == pytest.approx(stacked.torch_error, rel=1e-9)


def test_a_routed_output_that_flips_no_more_often_than_eager_passes_though_one_draw_fails():
    """Draw 0: the program routes a token otherwise, eager routes all as float64 (seed 4 of
    `tilefuse run --model mixtral` on the CPU); over the draws each flips at times."""
    gen = torch.Generator().manual_seed(2)
    first = routed_draw(gen, True, False)
    assert not compare("logits", first.outs[0], first.refs[0], first.torch_outs[0]).ok, "one draw fails it"
    (c,) = check_outputs(["logits"], first, lambda k: routed_draw(gen, k % 4 == 0, k % 2 == 0), draws=VALUES)
    assert c.ok and c.draws == VALUES, c


def test_a_routed_output_that_flips_on_every_draw_fails_where_eager_flips_rarely():
    gen = torch.Generator().manual_seed(3)
    (c,) = check_outputs(["logits"], routed_draw(gen, True, False),
                         lambda k: routed_draw(gen, True, k % 8 == 0), draws=VALUES)
    assert not c.ok and c.draws == VALUES, c


def test_a_nan_on_any_draw_fails_the_pooled_check():
    gen = torch.Generator().manual_seed(4)

    def draw(k):
        r = routed_draw(gen, False, False)
        if k == 5:
            r.outs[0][3, 3] = float("nan")
        return r

    (c,) = check_outputs(["logits"], draw(0), draw, draws=8)
    assert not c.ok and "draw 5" in c.note and "NaN" in c.note


def test_draws_one_keeps_large_outputs_on_the_first_draw():
    gen = torch.Generator().manual_seed(5)

    def draw(k):
        raise AssertionError("no draw wanted")

    first = routed_draw(gen, False, False)
    assert check_outputs(["logits"], first, draw)[0].draws == 1


@pytest.mark.usefixtures("fresh_backend")
@pytest.mark.parametrize("seed", [4, 7])
def test_cli_mixtral_passes_on_the_seeds_where_its_one_draw_failed(seed, capsys, monkeypatch):
    """At `run --model mixtral`'s sizes, on the CPU, these seeds FAILed on one draw: a token
    whose router scores nearly tie (1.5 bf16 ulps apart) routed otherwise than in float64."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["run", "--model", "mixtral", "--layers", "2", "--hidden", "512", "--device", "cpu",
                 "--seed", str(seed)]) == 0
    out = capsys.readouterr().out
    assert f"pass over {VALUES} draws" in out and "mixture of experts" in out
