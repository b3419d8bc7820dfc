"""runtime.gemm.Workspace: the split-K / stream-K scratch GEMM launches share, checked on the CPU
with stand-ins for the GPU (an allocator that hands a freed block to the next request of its
size, as the caching allocator does, and an intercepted cuLaunchKernel that decodes the
parameter block each launch passes).

Properties:
- each kind of buffer (f32 partials, int32 counters) grows on its own, at least doubling, and is
  handed out again while it is large enough; counters come zeroed; a reservation makes one
  buffer of each kind, of exactly the size reserved;
- a launch passes the partials and counters of the workspace it runs with: when a capture's
  workspace is freed and a later one gets the partials' address back with its counters
  elsewhere, the launch does not reuse the argument block built for the first (it passed the
  freed counters, another tensor's memory by then);
- inside a CUDA-graph capture tilefuse did not begin, each launch gets a fresh workspace the
  kernel keeps, not its stream's shared one (whose counters' zeroing another graph recorded).
"""
from __future__ import annotations

import ctypes
import weakref

import pytest
import torch

pytest.importorskip("cuda.bindings", reason="the launch path needs cuda-python's driver bindings")

from cuda.bindings import driver  # noqa: E402

from tilefuse.codegen import gemm_sm90  # noqa: E402
from tilefuse.runtime import gemm as rt  # noqa: E402


class _Memory:
    """A stand-in device: blocks of a CPU buffer, a freed block handed to the next request of its
    size (last freed first)."""

    def __init__(self):
        self.pool = torch.zeros(16 << 20, dtype=torch.uint8)
        self.free: dict = {}
        self.top = 0

    def alloc(self, n: int, device: int, zeroed: bool) -> torch.Tensor:
        nbytes = -(-4 * n // 512) * 512
        spare = self.free.get(nbytes)
        off = spare.pop() if spare else self.top
        if not spare and off == self.top:
            self.top += nbytes
        t = self.pool[off:off + nbytes].view(torch.int32 if zeroed else torch.float32)[:n]
        t.fill_(0 if zeroed else 7)  # (a freed block keeps what it held: partials get junk)
        weakref.finalize(t, lambda: self.free.setdefault(nbytes, []).append(off))
        return t


@pytest.fixture
def memory(monkeypatch):
    m = _Memory()
    monkeypatch.setattr(rt, "_alloc", m.alloc)
    monkeypatch.setattr(rt, "_STREAMS", {})
    return m


def test_each_kind_grows_on_its_own_at_least_doubling_and_counters_come_zeroed(memory):
    w = rt.Workspace()
    p1, f1 = w.get(0, 1000, 10)
    assert (p1.numel(), f1.numel()) == (1000, 10) and int(f1.abs().sum()) == 0
    assert w.get(0, 900, 10) == (p1, f1)  # large enough: the same buffers
    p2, f2 = w.get(0, 1000, 11)  # only the counters grow
    assert p2 is p1 and f2.numel() == 20 and int(f2.abs().sum()) == 0
    p3, f3 = w.get(0, 5000, 3)
    assert p3.numel() == 5000 and f3 is f2
    assert w.nbytes() == 4 * (1000 + 5000 + 10 + 20)  # (the smaller ones kept: graphs hold their addresses)
    r = rt.Workspace()
    r.reserve(0, 4096, 64)
    assert r.nbytes() == 4 * (4096 + 64)
    assert [t.numel() for t in r.get(0, 4000, 64)] == [4096, 64] and r.nbytes() == 4 * (4096 + 64)


def _split_k_kernel(monkeypatch, seen: list) -> rt.GemmKernel:
    """A split-K GEMM whose launches only record the (partials, counters) they were passed."""
    src = gemm_sm90.render(gemm_sm90.GemmProblem(1, 4096, 4096, "bf16"),
                           gemm_sm90.GemmSchedule(64, 128, stages=8, consumers=1, tma_store=False, split_k=4))
    assert src.workspace and src.flags
    k = rt.GemmKernel(src, None, True)
    k._loaded[0] = (None, "func", 8, None)
    monkeypatch.setattr(k, "_tensor_maps", lambda *a, **kw: (b"\0" * 128, b"\0" * 128))
    monkeypatch.setattr(rt, "_raw_stream", lambda device: 0xABC)

    def launch(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        arr = (ctypes.c_void_p * (4 + len(src.params))).from_address(params)  # 2 maps, partials, counters, ...
        seen.append(tuple(ctypes.c_void_p.from_address(arr[i]).value for i in (2, 3)))
        return (driver.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(driver, "cuLaunchKernel", launch)
    return k


def _pointers(k: rt.GemmKernel) -> list:
    """Made-up addresses for A, B and the epilogue's parameters (nothing reads them)."""
    return [0x10000, 0x20000] + [0x30000 + 0x1000 * i for i in range(len(k.source.params))]


def test_a_launch_passes_its_own_workspace_after_a_freed_ones_partials_address_comes_back(memory, monkeypatch):
    seen: list = []
    k = _split_k_kernel(monkeypatch, seen)
    ptrs = _pointers(k)
    first = rt.Workspace()
    with rt.capturing(first):
        k.launch_ptrs(0, ptrs)
    assert seen[-1] == tuple(t.data_ptr() for t in first.get(0, 0, 0))
    old_flags = first.flags[0][-1].data_ptr()
    del first  # a dropped capture: its blocks go back
    other = memory.alloc(k.source.flags, 0, zeroed=True)  # another tensor takes the counters' block
    assert other.data_ptr() == old_flags
    second = rt.Workspace()
    with rt.capturing(second):
        k.launch_ptrs(0, ptrs)
    partials, flags = (t.data_ptr() for t in second.get(0, 0, 0))
    assert partials == seen[0][0], "the stand-in allocator did not give the partials' address back"
    assert seen[-1] == (partials, flags) and seen[-1][1] != other.data_ptr()


def test_launches_outside_a_capture_share_their_streams_workspace(memory, monkeypatch):
    seen: list = []
    k = _split_k_kernel(monkeypatch, seen)
    ptrs = _pointers(k)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    k.launch_ptrs(0, ptrs)
    k.launch_ptrs(0, [p + 0x100 for p in ptrs])
    (arena,) = rt._STREAMS.values()
    assert seen[0] == seen[1] == tuple(t.data_ptr() for t in arena.get(0, 0, 0)) and not k._foreign


def test_inside_a_capture_tilefuse_did_not_begin_each_launch_gets_a_workspace_the_kernel_keeps(memory, monkeypatch):
    seen: list = []
    k = _split_k_kernel(monkeypatch, seen)
    ptrs = _pointers(k)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    k.launch_ptrs(0, ptrs)
    k.launch_ptrs(0, ptrs)
    assert not rt._STREAMS and len(k._foreign) == 2
    assert seen[0] != seen[1]
    assert [seen[i] == tuple(t.data_ptr() for t in k._foreign[i].get(0, 0, 0)) for i in (0, 1)] == [True, True]
