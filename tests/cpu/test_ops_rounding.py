"""The interpreters' scalar ops (tilefuse.ops) round a 32- or 16-bit transcendental once, from
float64, as PyTorch's CPU results are rounded: NumPy's own float32 versions are up to an ulp
or more off, which a later truncation to an integer or a large remainder makes visible."""
import math

import numpy as np
import pytest
import torch

from tilefuse import compile as tf_compile
from tilefuse.ops import OPS


@pytest.mark.parametrize("name, x, exact", [
    ("sin", 1.0, math.sin(1.0)),          # NumPy's float32 sin(1) is an ulp above this
    ("expm1", 17.0, math.expm1(17.0)),    # NumPy's float32 expm1(17) an ulp below
    ("exp", 0.5, math.exp(0.5)),
    ("tanh", 0.3, math.tanh(float(np.float32(0.3)))),
])
def test_a_float32_transcendental_is_the_float64_value_rounded_once(name, x, exact):
    got = OPS[name].numpy(np.array([x], np.float32))
    assert got.dtype == np.float32 and got[0] == np.float32(exact)


def test_float16_and_float64_keep_their_type():
    assert OPS["cos"].numpy(np.array([1.0], np.float16)).dtype == np.float16
    x = np.array([1.0, 2.0])
    assert np.array_equal(OPS["cos"].numpy(x), np.cos(x))
    assert OPS["pow"].numpy(np.array([2.0], np.float32), 3).dtype == np.float32


def test_a_program_truncating_an_expm1_to_int_truncates_the_rounded_value():
    """expm1 of int8 values (float32 results) truncated to int32 gives the float64 value rounded
    once to float32, then truncated: at 17, 24154952 as PyTorch's CPU (the interpreter had
    24154950, a fuzzing finding); at -17, 0, where PyTorch's own expm1 rounds to -1.0 (true
    -0.99999996, nearer the float32 just above -1)."""
    def f(a):
        return torch.expm1(a).int()

    a = torch.arange(-20, 20, dtype=torch.int8).reshape(4, 10)
    got = tf_compile(f, [a])(a)
    assert torch.equal(got, torch.expm1(a.double()).float().int())
    assert got[3, 7] == f(a)[3, 7] == 24154952 and got[0, 3] == 0
