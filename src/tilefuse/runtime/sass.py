"""A cubin's SASS, through nvdisasm: what ptxas made of a kernel, where the source is not enough.

    ops = opcodes(disassemble(nvrtc.compile_cuda(src, name, "sm_90a").data))

ptxas reorders: session 51 found a GEMV's loads written before `griddepcontrol.wait` scheduled
after it, which only the SASS shows. nvdisasm comes with a CUDA toolkit, or from PyPI's
`nvidia-cuda-nvdisasm` (in the dev extras); `available()` says whether either is here.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile


def nvdisasm() -> str | None:
    """The nvdisasm binary: on PATH, else the one the nvidia-cuda-nvdisasm wheel installs."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for sub in sorted(os.listdir(root), reverse=True):  # cu13 before cu12
            path = os.path.join(root, sub, "bin", "nvdisasm")
            if os.access(path, os.X_OK):
                return path
    return None


def available() -> bool:
    return nvdisasm() is not None


def disassemble(cubin: bytes) -> str:
    """nvdisasm's text of a cubin (no color)."""
    tool = nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found: install a CUDA toolkit or `pip install nvidia-cuda-nvdisasm`")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], check=True, capture_output=True, text=True).stdout


_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")


def opcodes(text: str) -> list[str]:
    """Each instruction's opcode with its modifiers (`LDG.E.NA.128.CONSTANT`), in code order."""
    return [m.group(1) + m.group(2) for m in map(_OP.search, text.splitlines()) if m]
