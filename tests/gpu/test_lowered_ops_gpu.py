"""Session 60's newly lowered ops on a GPU (each was a PyTorch extern): masked_fill, the
pointwise losses, xlogy, addcmul / addcdiv, lerp, sign, trunc, frac, nan_to_num, logaddexp,
sinc, the new math ops (ceil, round, log10, the trigonometric and hyperbolic functions and
their inverses, erfc, lgamma, atan2, hypot, fmod, remainder, copysign, fmin / fmax, logit) and
the float tests (isnan, isinf, isfinite, signbit), and session 61's: roll, `.T` / `.mT`, and
composite ops lowered through their decompositions (reshape_as, swapdims, linalg.norm, diff,
true_divide), all / any / count_nonzero / nansum / nanmean / dot, flip and F.pad, and session
63's integer floor / truncating division and remainder, against a float64 reference (the 2x
rule; integer results exactly), outputs poisoned, no extern in the plan, in the thin call and
replays. GPT-2's written-out GELU after a matmul (a sigmoid in the epilogue)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

CASES = {
    "masked_fill": lambda x, y: torch.softmax(x.masked_fill(y > 0.5, float("-inf")), -1),
    "losses": lambda x, y: (F.l1_loss(x, y), F.mse_loss(x, y, reduction="sum"), F.smooth_l1_loss(x, y, beta=0.5),
                            F.huber_loss(x, y, delta=2.0, reduction="none")),
    "bce": lambda x, y: (F.binary_cross_entropy_with_logits(x * 4, torch.sigmoid(y)),
                         F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(y))),
    "kl_div": lambda x, y: F.kl_div(F.log_softmax(x, -1), F.softmax(y, -1), reduction="batchmean"),
    "pointwise": lambda x, y: (torch.addcmul(x, x, y, value=0.5), torch.addcdiv(x, x, y.abs() + 1), torch.lerp(x, y, 0.7),
                               torch.sign(x), torch.trunc(x * 3), torch.frac(x * 3), torch.sinc(x),
                               torch.logaddexp(x, y), torch.xlogy(x.abs(), y.abs()),
                               torch.nan_to_num(torch.log(x))),
    "math": lambda x, y: (torch.ceil(x * 3), torch.round(x * 3), torch.log10(x.abs() + 1), torch.tan(x.clamp(-1, 1)),
                          torch.atan(x), torch.asin(x.clamp(-0.9, 0.9)), torch.acos(x.clamp(-0.9, 0.9)), torch.sinh(x),
                          torch.cosh(x), torch.asinh(x), torch.acosh(x.abs() + 1), torch.atanh(x.clamp(-0.9, 0.9)),
                          torch.erfc(x), torch.lgamma(x.abs() + 0.5), torch.atan2(x, y), torch.hypot(x, y),
                          torch.fmod(x * 4, y), torch.remainder(x * 4, y), torch.copysign(x, y), torch.fmin(x, y.log()),
                          torch.logit(torch.sigmoid(x)), torch.square(x), torch.deg2rad(x)),
    "tests": lambda x, y: (torch.isnan(x.log()), torch.isinf((x * 0).log()), torch.isfinite(x.log()), torch.signbit(x),
                           torch.logical_xor(x > 0, y > 0)),
    "views": lambda x, y: (torch.roll(x, 7, -1) * y, torch.roll(x, (3, -50), (0, 1)) + 1, x.T * 2, y.mT.exp(),
                           torch.softmax(torch.roll(x, -13, 1) + y, -1)),
    "composites": lambda x, y: (x.reshape_as(y.T.contiguous()) * 2, x.swapdims(0, 1) + 1, torch.linalg.norm(x, dim=-1),
                                x.diff(dim=-1), torch.true_divide(x, y.abs() + 1)),
    "flips and pads": lambda x, y: (x.flip(-1) * y, torch.flipud(x) + 1, F.pad(x, (3, 5)) * 2,
                                    F.pad(x, (1, 1, 2, 0), value=-1.0), torch.softmax(F.pad(x, (0, 56), value=float("-inf")), -1),
                                    F.pad(x[None], (2, -3), mode="replicate"), x * (7 - torch.arange(200, device=x.device))),
    # session 63: integer floor / truncating division and remainder (int64 results: compared exactly)
    "integer division": lambda x, y: (lambda a, b: (a // b, a % b, torch.div(a, b, rounding_mode="trunc"),
                                                    torch.div(a, 7, rounding_mode="floor"), -a % 5))(
        (x.float() * 50).long(), (y.float() * 5).long().masked_fill((y.float() * 5).long() == 0, 3)),
    "reductions": lambda x, y: ((x > -2).all(-1), (x > 2).any(-1), torch.count_nonzero(torch.relu(x), -1),
                                x.log().nansum(-1), x.log().nanmean(-1), torch.dot(x[0], y[0])),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_lowered_ops_match_the_reference(case, dtype):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    fn = CASES[case]
    torch.manual_seed(5)
    ins = (torch.randn(96, 200, device="cuda", dtype=dtype), torch.randn(96, 200, device="cuda", dtype=dtype))
    prog = tilefuse.compile(fn, ins, graphs=True)
    prog.poison = True
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    ref, eager = float64_reference(fn, ins), fn(*ins)
    ref, eager = (ref if isinstance(ref, tuple) else (ref,)), (eager if isinstance(eager, tuple) else (eager,))
    for call in range(3):
        got = prog(*ins)
        got = got if isinstance(got, tuple) else (got,)
        for i, (g, r, e) in enumerate(zip(got, ref, eager)):
            if g.dtype in (torch.bool, torch.int64):
                assert torch.equal(g, e), f"call {call} out {i}"
                continue
            c = compare(f"call {call} out {i}", g, r, e)
            assert c.ok, c


def test_gpt2_gelu_written_out_runs_as_a_sigmoid_in_the_epilogue():
    import tilefuse
    from tilefuse.check import compare, float64_reference
    from tilefuse.graph import ir

    def gelu(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    torch.manual_seed(6)
    x = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 768, device="cuda", dtype=torch.bfloat16) * 0.05
    fn = lambda x, w: gelu(x @ w.T)  # noqa: E731
    prog = tilefuse.compile(fn, (x, w))
    prog.poison = True
    (gemm,) = [s for s in prog.plan.steps if s.family == "gemm"]
    assert [s.family for s in prog.plan.steps if s.family not in ("gemm", "alias")] == [], str(prog.plan)
    assert any(isinstance(prog.graph[n], ir.Map) and prog.graph[n].op == "sigmoid" for n in gemm.nodes)
    c = compare("gelu", prog(x, w), float64_reference(fn, (x, w)), fn(x, w))
    assert c.ok, c
