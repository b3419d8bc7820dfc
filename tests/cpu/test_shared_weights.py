"""runtime/shared_weights.py: one copy of each weight for all the programs of a graph.

Properties checked:
- `WeightPool.share(weights)` replaces, in the dict it is given, a tensor equal bit for bit to
  one already pooled by that pooled tensor (the same object afterwards) and returns the bytes
  it saved: 0 for the first dict, the dict's size for a second equal one; `shared_bytes` sums
  the savings over calls.
- Only bit-equal tensors of the same shape, dtype and strides are shared: different values
  (also one element the fingerprint does not sample), -0.0 and 0.0, NaNs of other bits, equal
  values in another dtype, equal data in another shape, a transposed view and a contiguous
  tensor all stay apart; NaNs of the same bits, bf16, fp16 and integer tensors are shared, and a
  tensor met again is left as it is (same object, 0 saved).
- The pool keeps nothing alive: a pooled tensor no one else holds is freed, and an equal
  tensor shared afterwards is kept as it is (0 saved). Non-tensors and empty or sparse tensors
  are left alone.
- `WeightPool.on(value, device)` gives one contiguous copy per source and device, the same
  object at every call, made again once no one holds it; a non-tensor gives a tensor.
- A weight sharing memory with a live parameter (`live`) is neither pooled nor replaced, so a
  model's in-place update never reaches another model's program (tests at the end).
- Through the torch.compile backend, the programs of two sizes hold the same weight memory,
  the derived weights as the same tensors.
"""
from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tilefuse.runtime.shared_weights import SAMPLES, WeightPool, _fingerprint

CPU = torch.device("cpu")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a pool holding `a` serves `b` with `a` (and says so in the bytes saved)."""
    pool = WeightPool()
    assert pool.share({"w": a}) == 0
    d = {"w": b}
    saved = pool.share(d)
    if d["w"] is a:
        assert saved == _nbytes(b)
        return True
    assert d["w"] is b and saved == 0
    return False


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


# -- share: what is shared --------------------------------------------------------------------


def test_an_equal_tensor_is_replaced_by_the_pooled_one_and_its_bytes_saved():
    pool = WeightPool()
    a, b = torch.randn(8, 4), torch.randn(16)
    first = {"a": a, "b": b}
    assert pool.share(first) == 0
    assert first["a"] is a and first["b"] is b
    second = {"a": a.clone(), "b": b.clone()}
    assert pool.share(second) == _nbytes(a) + _nbytes(b)
    assert second["a"] is a and second["b"] is b


def test_equal_tensors_within_one_dict_are_shared():
    pool = WeightPool()
    a = torch.randn(5, 3)
    d = {"x": a, "y": a.clone()}
    assert pool.share(d) == _nbytes(a)
    assert d["x"] is a and d["y"] is a


def test_shared_bytes_accumulates_over_calls():
    pool = WeightPool()
    a, b = torch.randn(10), torch.randn(3, 3)
    keep = {"a": a, "b": b}
    pool.share(keep)
    assert pool.shared_bytes == 0
    pool.share({"a": a.clone()})
    assert pool.shared_bytes == _nbytes(a)
    pool.share({"a": a.clone(), "b": b.clone()})
    assert pool.shared_bytes == 2 * _nbytes(a) + _nbytes(b)


def test_a_tensor_met_again_is_left_as_is_with_nothing_saved():
    pool = WeightPool()
    a = torch.randn(4, 4)
    assert pool.share({"a": a}) == 0
    d = {"a": a}
    assert pool.share(d) == 0 and d["a"] is a
    assert pool.shared_bytes == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64,
                                   torch.int8, torch.uint8, torch.bool])
def test_bit_equal_tensors_of_every_dtype_are_shared(dtype):
    t = (torch.randn(6, 7) * 50).to(dtype)
    assert _shares(t, t.clone())


def test_nans_of_the_same_bits_are_shared():
    bits = [0x7FC00000, 0x7FC00001, -1, 0x3F800000]  # quiet NaN, NaN with payload, all-ones NaN, 1.0
    assert _shares(_f32(bits), _f32(bits))


def test_equal_transposed_views_of_other_storages_are_shared():
    a = torch.randn(6, 4)
    assert _shares(a.t(), a.clone().t())


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int16, torch.int64]),
       st.lists(st.integers(1, 9), min_size=1, max_size=3), st.data())
def test_a_copy_is_shared_and_a_copy_with_one_bit_flipped_is_not(dtype, shape, data):
    t = (torch.randn(shape) * 100).to(dtype)
    assert _shares(t, t.clone())
    flipped = t.clone()
    ints = flipped.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).view(-1)
    i = data.draw(st.integers(0, t.numel() - 1))
    ints[i] ^= 1 << data.draw(st.integers(0, 8 * t.element_size() - 2))
    assert not _shares(t, flipped)


# -- share: what is not shared ----------------------------------------------------------------


def test_different_values_are_not_shared():
    a = torch.randn(3, 5)
    assert not _shares(a, a + 1)


def test_negative_zero_is_not_shared_with_zero():
    assert not _shares(torch.zeros(8), -torch.zeros(8))


def test_nans_of_other_bits_are_not_shared():
    assert not _shares(_f32([0x7FC00000, 0]), _f32([0x7FC00001, 0]))


@pytest.mark.parametrize("old,new", [(1.0, 2.0), (0.0, -0.0)], ids=["value", "signed_zero"])
def test_one_unsampled_element_differing_is_caught_by_the_full_comparison(old, new):
    """A tensor of more than 2 * SAMPLES elements is sampled with a stride of 2 or more, so
    element 1 is not read for the fingerprint: the fingerprints agree, the tensors must not."""
    a = torch.full((2 * SAMPLES + 5,), old)
    b = a.clone()
    b[1] = new
    assert _fingerprint(a) == _fingerprint(b)
    assert not _shares(a, b)


def test_an_unsampled_nan_of_other_bits_is_caught_by_the_full_comparison():
    a = torch.zeros(2 * SAMPLES + 5, dtype=torch.int32)
    a[1] = 0x7FC00000
    b = a.clone()
    b[1] = 0x7FC00001
    a, b = a.view(torch.float32), b.view(torch.float32)
    assert _fingerprint(a) == _fingerprint(b)
    assert not _shares(a, b)


def test_equal_values_in_another_dtype_are_not_shared():
    a = torch.arange(12, dtype=torch.float32)
    assert not _shares(a, a.to(torch.float64))
    assert not _shares(a.to(torch.int32), a.to(torch.int64))


def test_equal_data_in_another_shape_is_not_shared():
    a = torch.randn(4, 6)
    assert not _shares(a, a.clone().reshape(6, 4))
    assert not _shares(a, a.clone().reshape(24))


def test_a_transposed_view_is_not_shared_with_a_contiguous_tensor_of_equal_values():
    """The pool's key holds the strides: equal shape and values with other strides stay apart."""
    a = torch.randn(5, 5)
    view = a.t()
    dense = view.contiguous()
    assert torch.equal(view, dense) and view.stride() != dense.stride()
    assert not _shares(view, dense)
    assert not _shares(dense, view)


# -- share: what is left alone and what is kept alive -----------------------------------------


def test_non_tensors_and_empty_or_sparse_tensors_are_left_alone():
    pool = WeightPool()
    sparse = torch.eye(3).to_sparse()
    first = {"n": 3, "s": "x", "arr": np.ones(3), "e": torch.empty(0), "z": torch.zeros(2, 0), "sp": sparse}
    before = dict(first)
    assert pool.share(first) == 0
    second = {"n": 3, "s": "x", "arr": np.ones(3), "e": torch.empty(0), "z": torch.zeros(2, 0),
              "sp": sparse.clone()}
    before2 = dict(second)
    assert pool.share(second) == 0
    assert all(first[k] is before[k] for k in before) and all(second[k] is before2[k] for k in before2)
    assert pool.shared_bytes == 0


def test_the_pool_keeps_no_tensor_alive():
    pool = WeightPool()
    d = {"w": torch.randn(64)}
    values = d["w"].clone()
    pool.share(d)
    ref = weakref.ref(d["w"])
    del d
    gc.collect()
    assert ref() is None
    new = {"w": values}
    assert pool.share(new) == 0 and new["w"] is values
    again = {"w": values.clone()}
    assert pool.share(again) == _nbytes(values) and again["w"] is values


# -- on ---------------------------------------------------------------------------------------


def test_on_returns_the_same_object_for_the_same_source_and_device():
    pool = WeightPool()
    src = torch.randn(3, 4)
    assert pool.on(src, CPU) is pool.on(src, CPU)
    assert pool.on(src, CPU) is pool.on(src, "cpu")


def test_on_a_contiguous_source_already_on_the_device_is_the_source_itself():
    pool = WeightPool()
    src = torch.randn(3, 4)
    assert pool.on(src, CPU) is src


def test_on_a_non_contiguous_source_gives_one_contiguous_copy():
    pool = WeightPool()
    src = torch.randn(4, 6).t()
    copy_ = pool.on(src, CPU)
    assert copy_.is_contiguous() and copy_ is not src
    assert torch.equal(copy_, src)
    assert pool.on(src, CPU) is copy_


def test_on_a_non_tensor_gives_a_tensor():
    pool = WeightPool()
    for value in (np.arange(6, dtype=np.float32).reshape(2, 3), [[1.0, 2.0], [3.0, 4.0]]):
        t = pool.on(value, CPU)
        assert isinstance(t, torch.Tensor) and t.is_contiguous() and t.device == CPU
        assert torch.equal(t, torch.as_tensor(value))


def test_on_makes_a_copy_no_one_holds_again_instead_of_keeping_it_alive():
    pool = WeightPool()
    src = torch.randn(4, 6).t()
    copy_ = pool.on(src, CPU)
    ref = weakref.ref(copy_)
    del copy_
    gc.collect()
    assert ref() is None
    again = pool.on(src, CPU)
    assert again.is_contiguous() and torch.equal(again, src)
    assert pool.on(src, CPU) is again


def test_on_keeps_no_source_alive():
    pool = WeightPool()
    src = torch.randn(4, 6).t()
    pool.on(src, CPU)
    ref = weakref.ref(src)
    del src
    gc.collect()
    assert ref() is None


# -- a pooled weight that aliases a parameter ---------------------------------------------------


def test_a_weight_aliasing_a_live_parameter_is_neither_pooled_nor_replaced():
    pool = WeightPool()
    p1 = nn.Parameter(torch.randn(8))
    p2 = nn.Parameter(p1.detach().clone())
    first = {"w": p1.detach(), "d": p1.detach() * 2}  # a first program's weights, alive
    pool.share(first, live=[p1])
    d = {"w": p2.detach(), "d": p2.detach() * 2}
    pool.share(d, live=[p2])
    assert d["w"] is not first["w"] and d["d"] is first["d"]  # the derived tensor is shared
    with torch.no_grad():
        p1.add_(1.0)
    assert torch.equal(d["w"], p2.detach())


# -- through the torch.compile backend ----------------------------------------------------------


from test_backend import NormMLP  # noqa: E402  (tests/cpu is on the path: pytest's rootdir import)


def _recording_backend(runners: list):
    """The tilefuse backend, keeping the GraphRunner it returns for each graph."""
    from tilefuse.frontend import backend as tb

    def backend(gm, example_inputs, **kw):
        runner = tb.tilefuse_backend(gm, example_inputs, **kw)
        runners.append(runner)
        return runner

    return backend


@pytest.mark.usefixtures("fresh_backend")
def test_the_programs_of_two_sizes_hold_the_same_weight_tensors():
    torch.manual_seed(0)
    m = NormMLP().eval()
    runners: list = []
    f = torch.compile(m, backend=_recording_backend(runners), dynamic=True)
    with torch.no_grad():
        for n in (3, 5):
            x = torch.randn(n, 16)
            torch.testing.assert_close(f(x), m(x))
    (runner,) = runners
    a, b = (v.program.graph.weights for v in runner.variants.values())
    assert a.keys() == b.keys() and len(a) >= 2
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert all(ptr(a[k]) == ptr(b[k]) for k in a)  # one copy of each weight for both sizes
    derived = [k for k in a if ptr(a[k]) not in params]
    assert derived and all(a[k] is b[k] for k in derived)  # the derived ones are pooled


@pytest.mark.usefixtures("fresh_backend")
def test_a_model_compiled_after_an_equal_one_is_unaffected_by_its_in_place_update():
    torch.manual_seed(1)
    m1 = NormMLP().eval()
    m2 = copy.deepcopy(m1)
    f1, f2 = torch.compile(m1, backend="tilefuse"), torch.compile(m2, backend="tilefuse")
    x = torch.randn(4, 16)
    with torch.no_grad():
        f1(x)
        f2(x)
        m1.up.bias.add_(1.0)
        f1(x)
        torch.testing.assert_close(f2(x), m2(x))


def test_intern_neither_pools_nor_replaces_what_aliases_a_live_parameter():
    """`intern` (a rewrite's weights as it makes them) keeps `share`'s rule: a tensor on a live
    parameter's memory is returned as it is, not pooled, and not swapped for an equal pooled one."""
    pool = WeightPool()
    p = nn.Parameter(torch.randn(8))
    alias = p.detach()
    assert pool.intern(alias, live=[p]) is alias
    copy_ = p.detach().clone()
    assert pool.intern(copy_) is copy_  # the alias was not pooled: the copy is the first of its value
    assert pool.intern(alias, live=[p]) is alias  # nor is it replaced by the equal pooled copy
    assert pool.intern(p.detach().clone()) is copy_


class _UnweightedNormLinear(nn.Module):
    """An RMSNorm with no gamma before a Linear: folding nothing, the rewrite hands back the
    Linear's own weight as the new operand (a view of the parameter)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32, bias=False)

    def forward(self, x):
        return self.lin(torch.nn.functional.rms_norm(x, (16,), eps=1e-6))


@pytest.mark.usefixtures("fresh_backend")
def test_a_rewrite_handing_back_a_parameter_does_not_pool_it_for_an_equal_model():
    """Two equal bf16 models compiled one after the other: the second's program must not read
    the first's parameter memory (found equal by the pool as the rewrite made it), so an
    in-place update of the first leaves the second's results as they were, bit for bit."""
    from tilefuse.graph.rules import match

    torch.manual_seed(2)
    m1 = _UnweightedNormLinear().to(torch.bfloat16).eval()
    m2 = copy.deepcopy(m1)
    made = []
    weight = match.Editor.weight

    def tracked(self, base, matrix, dtype, source):
        w = weight(self, base, matrix, dtype, source)
        made.append(self.weights[w.name])
        return w

    f1, f2 = torch.compile(m1, backend="tilefuse"), torch.compile(m2, backend="tilefuse")
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(match.Editor, "weight", tracked)
        f1(x)
        before = f2(x).clone()
        params = {p.untyped_storage().data_ptr() for p in (*m1.parameters(), *m2.parameters())}
        assert any(t.untyped_storage().data_ptr() in params for t in made), \
            "no rewrite handed back a parameter: the property is untested"
        m1.lin.weight.mul_(2.0)
        assert torch.equal(f2(x), before)
