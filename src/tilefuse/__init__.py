"""tilefuse: a readable compiler from PyTorch programs to fused CUDA kernels."""

__version__ = "0.1.0"
