"""torch.roll lowers to roll views (graph/ir.py View "roll"): a kernel reads the rolled tensor
where it lies, at index (i - shift) % size, so a roll followed by maps is one kernel and no copy."""
import pytest
import torch

import tilefuse


@pytest.mark.parametrize("shape, shifts, dims", [
    ((6, 10), 3, 1), ((6, 10), -4, -1), ((6, 10), 13, 0), ((6, 10), 7, None), ((6, 10), 0, 1),
    ((3, 5, 7), (1, -2), (0, 2)), ((3, 5, 7), (2, 2), (1, 1)), ((1, 9), 4, 0), ((5,), 12, 0),
])
def test_roll_then_a_map_is_one_kernel_equal_to_eager(shape, shifts, dims):
    torch.manual_seed(0)
    x = torch.randn(shape)
    fn = (lambda x: torch.roll(x, shifts) * 2.0 + 1.0) if dims is None else \
        (lambda x: torch.roll(x, shifts, dims) * 2.0 + 1.0)
    prog = tilefuse.compile(fn, (x,))
    assert not [s for s in prog.plan.steps if s.family == "extern" and not s.view], str(prog.plan)
    assert len([s for s in prog.plan.steps if s.family == "mapreduce"]) <= 1, str(prog.plan)
    torch.testing.assert_close(prog(x), fn(x))


def test_a_roll_returned_as_it_is_comes_back_rolled():
    """A roll no kernel reads is a program output made by PyTorch's roll (program.strided_view)."""
    x = torch.randn(4, 9)
    prog = tilefuse.compile(lambda x: torch.roll(x, 2, 1), (x,))
    torch.testing.assert_close(prog(x), torch.roll(x, 2, 1))


def test_a_roll_feeding_a_reduction_is_read_in_place():
    torch.manual_seed(1)
    x = torch.randn(8, 33)
    fn = lambda x: torch.softmax(torch.roll(x, 5, -1) * x, -1)  # noqa: E731
    prog = tilefuse.compile(fn, (x,))
    assert [s.family for s in prog.plan.steps if not s.view and s.family != "alias"] == ["mapreduce"], str(prog.plan)
    torch.testing.assert_close(prog(x), fn(x))
