"""tilefuse.check.float64_reference is float64 all the way, floats made from integers included.

Properties: a float made from an integer tensor, by a cast (`.bfloat16()`, `.to(torch.half)`,
`.float()`) or by promotion (`cos` of an int tensor), is float64 in the reference, so a
program whose floats all come from integers has a reference more exact than eager, not eager
itself; the default dtype is put back afterwards; and `tilefuse run` passes such a program
(an instance norm of a bf16 cast of random integers FAILed, error 3e-3 against PyTorch's 0).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tilefuse.check import compare, float64_reference
from tilefuse.cli import main


@pytest.mark.parametrize("cast", [lambda t: t.bfloat16(), lambda t: t.half(), lambda t: t.float(),
                                  lambda t: t.to(torch.bfloat16), lambda t: t.type(torch.float16)])
def test_a_float_cast_of_integers_is_float64_in_the_reference(cast):
    x = torch.randint(-128, 128, (5, 33))
    ref = float64_reference(lambda t: F.layer_norm(cast(t), (33,)), [x])
    assert ref.dtype == torch.float64
    exact = F.layer_norm(x.double(), (33,))
    assert torch.equal(ref, exact)


def test_a_promotion_of_integers_is_float64_in_the_reference_and_the_default_is_restored():
    x = torch.randint(0, 1000, (64,))
    assert torch.get_default_dtype() == torch.float32
    ref = float64_reference(lambda t: torch.cos(t) * 3, [x])
    assert ref.dtype == torch.float64 and torch.equal(ref, torch.cos(x.double()) * 3)
    assert torch.get_default_dtype() == torch.float32


def test_the_reference_of_an_integer_made_bf16_program_is_not_eager():
    torch.manual_seed(0)
    x = torch.randint(-128, 128, (5, 33, 33))
    eager = F.instance_norm(x.bfloat16())
    ref = float64_reference(lambda t: F.instance_norm(t.bfloat16()), [x])
    c = compare("out", eager, ref, eager)
    assert c.torch_error > 1e-3, "eager's own bf16 rounding is measured against a float64 value"


def test_run_passes_a_correctly_rounded_instance_norm_of_integers(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["run", "-c", "F.instance_norm(torch.randint(-128, 128, (5, 33, 33)).bfloat16())",
                 "--device", "cpu", "--seed", "1"]) == 0
    assert "pass" in capsys.readouterr().out
