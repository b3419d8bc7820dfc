"""Fixtures shared by the CPU and the GPU tests."""
import pytest


@pytest.fixture(autouse=True)
def _fresh_gemm_renders():
    """Sources rendered for one M serve others (gemm_sm90.render's memo): each test starts with
    none kept, so what it renders does not depend on which tests ran before it."""
    from tilefuse.codegen import gemm_sm90

    gemm_sm90._RENDERED.clear()
    yield
