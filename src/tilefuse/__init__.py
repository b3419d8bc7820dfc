"""tilefuse: a readable compiler from PyTorch programs to fused CUDA kernels."""

__version__ = "0.1.0"


def compile(fn, example_inputs, **kwargs):
    """Compile `fn` (callable or nn.Module) for `example_inputs`; returns a callable like it."""
    from .compiler import compile as _compile

    return _compile(fn, example_inputs, **kwargs)
