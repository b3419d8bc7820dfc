"""Fixtures shared by the CPU and the GPU tests."""
import pytest


@pytest.fixture(autouse=True)
def _fresh_gemm_renders():
    """Sources rendered for one M serve others (gemm_sm90.render's memo): each test starts with
    none kept, so what it renders does not depend on which tests ran before it."""
    from tilefuse.codegen import gemm_sm90

    gemm_sm90._RENDERED.clear()
    yield


def _filled(m):
    """Module m in eval mode, its weights and running statistics drawn (variances in [0.5, 1.5)),
    so that a norm's affine and running statistics are not the identity they start as."""
    import torch

    with torch.no_grad():
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if t.is_floating_point():
                t.copy_(torch.rand_like(t) + 0.5 if "var" in name else torch.randn_like(t))
    return m.eval()


@pytest.fixture
def filled():
    return _filled
