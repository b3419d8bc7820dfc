"""Compiled programs have no backward: an input that requires grad gets one warning, not silence."""
import warnings

import pytest
import torch

import tilefuse


def _prog():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    return tilefuse.compile(m, (torch.randn(4, 8),))


def test_an_input_that_requires_grad_warns_once_that_results_carry_no_gradient():
    prog, x = _prog(), torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="no backward") as got:
        y = prog(x)
    assert y.grad_fn is None
    assert got[0].filename == __file__  # it points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prog(x)  # once per program


@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "plain input"])
def test_no_warning_where_no_gradient_is_asked_for(how):
    """Weights that require grad (every nn.Module's) are not a request for one: only inputs in grad mode are."""
    prog = _prog()
    x = torch.randn(4, 8, requires_grad=how != "plain input")
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(how)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if ctx:
            with ctx():
                prog(x)
        else:
            prog(x)


def test_the_warning_is_not_repeated_after_a_recompile_for_changed_weights():
    """A training-style loop (call, update the weights, call): the weight change recompiles the
    program, which keeps having warned."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(4, 8, requires_grad=True)
    prog = tilefuse.compile(m, (x.detach(),))
    with pytest.warns(UserWarning, match="no backward"):
        prog(x)
    with torch.no_grad():
        m[0].weight.mul_(2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        prog(x)
    said = [str(w.message) for w in seen]
    assert any("compiling the program again" in s for s in said)
    assert not any("no backward" in s for s in said)
