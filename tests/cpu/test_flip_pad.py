"""flip and F.pad (constant and replicate; negative pads crop) lower to gathers along each dim
(an index of n - 1 - i, or the clamped i - before with the value outside), and maps of
constants and indices alone are computed in each kernel that reads them (fusion.generated_maps):
a flip or a pad along one dim and the maps around it are one kernel, equal to eager."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse


def _kernels(p):
    return [s.family for s in p.plan.steps if s.family not in ("alias",) and not s.view]


@pytest.mark.parametrize("name, fn", [
    ("flip last", lambda x: x.flip(-1) * 2),
    ("flip first", lambda x: torch.flipud(x) + 1),
    ("fliplr", lambda x: torch.fliplr(x).exp()),
    ("pad", lambda x: F.pad(x, (1, 2)) * 2),
    ("pad value", lambda x: F.pad(x, (3, 0), value=-1.5) * 0.5),
    ("pad crop", lambda x: F.pad(x, (-1, 2), value=3.0)),
    ("crop", lambda x: F.pad(x, (-2, -1)) * 2),
    ("replicate", lambda x: F.pad(x.unsqueeze(0), (2, 3), mode="replicate") * 2),
    ("replicate crop", lambda x: F.pad(x.unsqueeze(0), (-2, 3), mode="replicate")),
    ("constant_pad_nd", lambda x: torch.constant_pad_nd(x, (1, 1), 2.0) - 1),
    ("pad softmax", lambda x: torch.softmax(F.pad(x, (0, 8), value=float("-inf")), -1)),
])
def test_one_dim_flips_and_pads_are_one_kernel_equal_to_eager(name, fn):
    torch.manual_seed(0)
    x = torch.randn(6, 9)
    p = tilefuse.compile(fn, (x,))
    assert _kernels(p) == ["mapreduce"], str(p.plan)
    got, want = p(x), fn(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn", [
    lambda x: x.flip((0, 2)) * 2,
    lambda x: F.pad(x, (1, 1, 2, 0), value=-1.0),
    lambda x: F.pad(x, (1, 1, 0, 2), mode="replicate"),
    lambda x: F.pad(x, (2, -3, -1, 0), value=3.0) + 1,
])
def test_several_dims_take_a_gather_each_and_equal_eager(fn):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 8)
    p = tilefuse.compile(fn, (x,))
    assert not [s for s in p.plan.steps if s.family == "extern" and not s.view], str(p.plan)
    torch.testing.assert_close(p(x), fn(x))


def test_integer_and_bool_tensors_keep_torchs_flip_and_pad():
    """A kernel gathers floats only; an integer or bool tensor (an attention mask) keeps one
    PyTorch op, not an index kernel and a torch.gather."""
    for x in (torch.randint(0, 9, (4, 7)), torch.rand(4, 7) > 0.5):
        for op, fn in (("flip", lambda x: x.flip(-1)), ("pad", lambda x: F.pad(x, (1, 1)))):
            p = tilefuse.compile(fn, (x,))
            assert f"tilefuse does not lower aten.{op} with a" in str(p.plan), str(p.plan)
            assert torch.equal(p(x), fn(x))


def test_reflect_padding_stays_an_extern_saying_why():
    x = torch.randn(2, 3, 8)
    p = tilefuse.compile(lambda x: F.pad(x, (1, 1), mode="reflect"), (x,))
    assert "aten.pad with mode 'reflect'" in str(p.plan), str(p.plan)


def test_a_map_of_indices_alone_is_computed_in_the_kernel_that_reads_it():
    """x * (7 - arange(8)) was two kernels: the map of the index wrote 8 integers for the
    multiply's kernel to read."""
    x = torch.randn(5, 8)
    fn = lambda x: x * (7 - torch.arange(8)) + torch.where(torch.arange(8) < 3, x, 0.0).sum(-1, keepdim=True)  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    assert _kernels(p) == ["mapreduce"], str(p.plan)
    torch.testing.assert_close(p(x), fn(x))


def test_a_map_of_indices_that_is_a_result_is_still_written():
    x = torch.randn(5, 8)
    fn = lambda x: (x * (7 - torch.arange(8)), 7 - torch.arange(8))  # noqa: E731
    p = tilefuse.compile(fn, (x,))
    got = p(x)
    assert torch.equal(got[1], fn(x)[1])
    torch.testing.assert_close(got[0], fn(x)[0])


def test_maps_of_constants_read_by_a_map_of_constants_are_planned_where_no_kernel_takes_them():
    """nan_to_num's limits are maps of constants read by other maps of constants (0-d, which a
    kernel cannot align where it computes them): each still has a kernel that writes it before
    its readers run (a GPU run found one that nothing wrote)."""
    torch.manual_seed(2)
    x = torch.randn(6, 9)
    y = torch.randn(6, 9)
    fn = lambda x, y: (torch.addcmul(x, x, y, value=0.5), torch.addcdiv(x, x, y.abs() + 1), torch.lerp(x, y, 0.7),  # noqa: E731
                       torch.sign(x), torch.trunc(x * 3), torch.frac(x * 3), torch.sinc(x), torch.logaddexp(x, y),
                       torch.xlogy(x.abs(), y.abs()), torch.nan_to_num(torch.log(x)))
    p = tilefuse.compile(fn, (x, y))
    written = set(p.graph.inputs) | set(p.graph.weights)
    from tilefuse.graph import ir
    for s in p.plan.steps:
        for t in s.inputs:
            assert t in written or isinstance(p.graph[t], (ir.Constant, ir.Iota)), f"{s.name} reads {t}, never written"
        written |= set(s.outputs) | (set(s.nodes) if s.family in ("alias", "extern") else set())
    for got, want in zip(p(x, y), fn(x, y)):
        torch.testing.assert_close(got, want, equal_nan=True)
