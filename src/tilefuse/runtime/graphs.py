"""CUDA-graph replay of a compiled program: one host call per program call.

A program's shapes are static, so after a warm-up call its kernel launches and extern
torch ops are captured once in a `torch.cuda.CUDAGraph` and each later call replays it
(a few microseconds of host time, however many kernels). A captured graph reads fixed
input addresses and writes fixed output buffers; a *slot* is one capture. Each input of a
slot is either
- direct: captured on the caller's own tensor, because the caller passed that storage twice
  in a row (a benchmark loop, a weight passed as an input, a static KV cache). The slot is
  replayed only where that input lies at exactly that address (contiguous), and it is never
  copied; or
- copied: captured on a private buffer, into which each call copies the caller's tensor.
An input whose address once differed from a direct slot's is copied in every later capture
(two tensors that happened to share an address, the caching allocator's doing, are not a
static buffer), unless it had lain at its old address for `SETTLED` calls or more: a buffer
the caller keeps and then replaces (each `generate` makes a new static KV cache and steps it
~32-1000 times) is read in place at its new address, by a slot captured there, the stale
slot evicted. Copying it instead would copy every layer's cache in and out again on every
step for the rest of the process (two foreach copies a step, ~0.2 ms of host time each at 8
layers, and twice the cache's bytes through the GPU). Inputs the program writes in place
(Graph.writes: a static cache's `index_copy_`, a step counter's `add_`) are written by the
replay itself where direct, and copied back to the caller's tensor where copied.

Outputs. A slot's output buffers are returned as fresh tensors that alias them, and a slot
is replayed only while the caller holds none of its previous outputs (the storage's use
count is back to what the slot itself holds). So a result the caller keeps is never
overwritten: `y = prog(x)` in a loop alternates between two slots, a caller keeping more
results gets another slot (up to `max_slots`), and past that the call takes the thin path
into fresh memory. Nothing is copied for this, unlike returning clones (which costs an extra
read and write of every output, measured in bench/LOG.md); `clone=True` selects that policy.

Streams. A replay runs on the caller's current stream (the capture itself is made on a side
stream, as torch requires). CUDA orders the launches of one graph behind each other, but not
behind the copy into a slot's inputs, nor behind work the caller queued after a replay that
reads its results (`y = prog(x); z = f(y); del y`): on one stream all of that is in order, and
a slot whose results are dropped may be replayed at once. When a slot was last replayed on
another stream, the call first makes the current stream wait for everything queued on that one,
the same guarantee the caching allocator gives a tensor freed with work still queued on it;
without the wait the next call's copy and replay overwrite buffers the other stream still reads.

Memory. A slot keeps its copied inputs' buffers and its graph's memory pool (its outputs and
intermediates) for as long as it lives, and every size of a growing cache is a program with
slots of its own: a decode step's slot that copies its cache holds it twice (before the step,
copied in; after it, the output), so a long generation's slots would grow with sizes x cache
length. All slots of the process share one limit per device (`GraphMemory`,
TILEFUSE_GRAPH_MEMORY: a fraction of the device's memory or a number of bytes, default a
quarter); once the slots hold that much, or the
device has less than an eighth of its memory free, new captures are skipped and those calls take
the thin path (`stats["over_budget"]`, one warning a process). The check comes before a capture,
whose size is known only after it, so the capture reaching the limit may pass it by its own
size. A slot's bytes return to the limit when it is dropped (its program freed, or evicted).
A capture does not empty the allocator's cache first (as `torch.cuda.graph` does, ~10 ms a
capture with the synchronize and collect around it) unless the device is short of memory
(`release_if_tight`).

A call made while the caller is capturing a CUDA graph of its own runs the thin path, so
its launches land in the caller's graph. Graphs are off on CPU devices, for programs with a step that cannot be captured (an extern
that syncs with the host), with `Program(graphs=False)`, or with TILEFUSE_CUDA_GRAPHS=0; by
default (`graphs=None`) a program of a single launch runs without one too (`blockers`).
A capture that fails turns them off for that program, with a warning naming why.
"""
from __future__ import annotations

import contextvars
import functools
import os
import re
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import env

ENV = "TILEFUSE_CUDA_GRAPHS"
MEMORY_ENV = "TILEFUSE_GRAPH_MEMORY"
DEFAULT_MEMORY = 0.25  # of the device's memory, for all captured slots together
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}

# aten ops that read a value back to the host or make a shape from data: not capturable
_HOST_SYNC = ("nonzero", "masked_select", "unique", "_local_scalar_dense", "item", "repeat_interleave",
              "bincount", "histc", "_assert_async", "equal", "is_nonzero")

_use_count = getattr(torch._C, "_storage_Use_Count", None)

# True while a program runs its first call at its sizes (the call before any capture): a
# one-off call, as every call of `generate`'s prefill and decode steps at a new length is.
# program.run_extern then runs attention where no per-shape plan is built (_PLANLESS there).
FIRST_CALL: contextvars.ContextVar = contextvars.ContextVar("tilefuse_first_call", default=False)


def enabled_by_env(environ=None) -> bool:
    """TILEFUSE_CUDA_GRAPHS=0 (or false/off/no) turns CUDA graphs off; anything else leaves them on."""
    return env.switch(ENV, environ)


def memory_limit(total: int | None, environ=None) -> float:
    """Bytes all captured slots of a device may hold: TILEFUSE_GRAPH_MEMORY as a fraction of the
    device's `total` bytes ("0.25": a number with a point, at most 1) or a size ("8GiB", "512MB",
    "1000000" bytes); unlimited where `total` is unknown (an emulated capture) and nothing is set."""
    raw = (os.environ if environ is None else environ).get(MEMORY_ENV, "").strip()
    if not raw:  # not env.raw: unset means a fraction of a known device's memory, else no limit
        return DEFAULT_MEMORY * total if total else float("inf")
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmg]i?b|b)?", raw.lower())
    if m is None:
        raise ValueError(f"{MEMORY_ENV}={raw!r}: give a fraction of the device's memory (0.25) or a size "
                         f"(8GiB, 512MiB, a number of bytes)")
    value, unit = float(m.group(1)), m.group(2) or ""
    if not unit and "." in m.group(1):
        if value > 1:
            raise ValueError(f"{MEMORY_ENV}={raw!r}: a fraction of the device's memory is at most 1")
        return value * total if total else float("inf")
    return value * _UNITS[unit]


class GraphMemory:
    """The bytes captured slots hold, per device, against `memory_limit`. A slot's bytes are
    taken at its capture and given back when the slot object is collected."""

    def __init__(self, limit: float | None = None, total=None, free=None):
        self.fixed = limit  # bytes for every device (tests); None: from the environment
        self.total = total or _device_total
        self.free = free or _device_free
        self.held: dict = {}
        self.warned = False  # (the limit reached: said once a process)
        self.bad_env = False

    def limit(self, device) -> float:
        if self.fixed is not None:
            return self.fixed
        total = self.total(device)
        try:
            return memory_limit(total)
        except ValueError as e:  # (read at a call's capture: a bad value must not fail the call)
            if not self.bad_env:
                self.bad_env = True
                warnings.warn(f"tilefuse: {e}; using the default, {DEFAULT_MEMORY} of the device", RuntimeWarning,
                              stacklevel=5)
            return memory_limit(total, {})

    def room(self, device) -> bool:
        """Whether a new slot may be captured on `device` now."""
        key = str(device)
        if self.held.get(key, 0) >= self.limit(device):
            return False
        total, free = self.total(device), self.free(device)
        return not total or free is None or free >= total / 8

    def take(self, device, nbytes: int, owner) -> None:
        key = str(device)
        self.held[key] = self.held.get(key, 0) + nbytes
        weakref.finalize(owner, self._give, key, nbytes)

    def _give(self, key, nbytes) -> None:
        self.held[key] = self.held.get(key, 0) - nbytes

    def why_full(self, device) -> str:
        gib = 1 << 30
        return (f"CUDA-graph memory on {device}: {self.held.get(str(device), 0) / gib:.2f} GiB held by captured "
                f"graphs, limit {self.limit(device) / gib:.2f} GiB ({MEMORY_ENV}), or under an eighth of the "
                f"device free")


@functools.lru_cache(maxsize=None)
def _device_total(device) -> int | None:
    if getattr(device, "type", None) != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def _device_free(device) -> int | None:
    """Free bytes on the device, counting the caching allocator's unused blocks as free."""
    if getattr(device, "type", None) != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


MEMORY = GraphMemory()


def launches(program) -> int:
    """Kernel, GEMM and extern launches per call (aliases and strided views: no launch)."""
    return sum(1 for step in program.plan.steps if step.family != "alias" and not step.view)


def _fixed_range_histc(op: str, n) -> bool:
    """A histc given its range (min < max, as Mixtral's router counts its experts) launches one
    kernel and reads nothing back; only min == max (the default) asks the GPU for the data's
    range first."""
    if op != "histc":
        return False
    args = dict(zip(("input", "bins", "min", "max"), n.args)) | dict(n.kwargs)
    lo, hi = args.get("min", 0), args.get("max", 0)
    return isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo < hi


def blockers(program, device: torch.device, auto: bool = False) -> list[str]:
    """Why this program does not run as a CUDA graph on `device` (empty when it does).

    auto: also leave out a program of one launch. Its graph saves no launch on the host, and
    on an H100 the replay cost up to 1.4 us of GPU time more than the same kernel launched
    directly: more in 11 of 12 paired comparisons, a tie in one (same run, same inputs, the
    kernel writing into the graph's own output buffer: bench/program_schedules.py, bench/LOG.md
    session 11)."""
    reasons = []
    if auto and launches(program) < 2:
        reasons.append("one launch: a graph saves no host launches and its replay adds GPU time "
                       "(graphs=True forces it)")
    if device.type != "cuda":
        reasons.append(f"its inputs are on {device}, not a CUDA device")
    for step in program.plan.steps:
        if step.family != "extern":
            continue
        n = program.graph[step.nodes[0]]
        target = getattr(n, "target", "")
        op = target.split(".")[1] if target.count(".") >= 1 else target
        if op in _HOST_SYNC and not _fixed_range_histc(op, n):
            reasons.append(f"extern {target} ({n.name}) syncs with the host or has a data-dependent shape")
    return reasons


@dataclass
class Slot:
    """One captured graph with the buffers it reads and writes."""

    replay: Callable[[], None]
    outs: list                  # the program's outputs as captured (its flat output order)
    private: tuple              # per output: lives in the graph's memory (else a weight or constant)
    inputs: list                # per input: its private buffer where copied, None where direct
    ptrs: tuple                 # per input: the address it reads where direct, None where copied
    storages: list = field(default_factory=list)  # distinct storages of the private outputs
    base: list = field(default_factory=list)      # their use counts with no caller holding one
    stream: int | None = None   # the stream of its last replay (a raw handle); None before the first
    copy_bytes: int = 0         # bytes a replay copies in (its copied inputs), and back out (written ones)

    def settle(self):
        """Record how the output storages are held while only the slot holds them."""
        self.base = [_holds(s) for s in self.storages] if _use_count else []

    def free(self) -> bool:
        """True when the caller holds nothing on any of this slot's output storages."""
        if _use_count is None:
            return True
        return [_holds(s) for s in self.storages] == self.base  # the same expression as settle's

    def fits(self, ptrs) -> bool:
        """Its direct inputs are at these addresses."""
        return all([p is None or p == q for p, q in zip(self.ptrs, ptrs)])

    def copies(self) -> int:
        return sum([p is None for p in self.ptrs])

    def results(self, clone: bool) -> list:
        if clone:
            return [t.clone() if p else t for t, p in zip(self.outs, self.private)]
        return [t.detach() if p else t for t, p in zip(self.outs, self.private)]


def _holds(storage) -> tuple[int, int]:
    """Tensors on a storage (its use count) and references to its Python object, which torch
    hands back again from `tensor.untyped_storage()`, so a caller keeping only that shows here."""
    return _use_count(storage._cdata), sys.getrefcount(storage)


class NotGraphable(RuntimeError):
    """A program whose captured outputs cannot be returned safely (one views an input)."""


def capture_cuda(runner, tensors, direct):
    """Warm up on a side stream, then capture `runner.run`; returns (replay, outs, private
    inputs: a buffer per copied input, None per direct one, the bytes of the graph's memory
    pool and of its GEMMs' one workspace). `direct`: per input."""
    from .. import collector
    from . import gemm

    device = runner.device
    with torch.cuda.device(device):
        static = [None if d else torch.empty(t.shape, dtype=t.dtype, device=device) for t, d in zip(tensors, direct)]
        for s, t in zip(static, tensors):
            if s is not None:
                s.copy_(t)
        inputs = [t if s is None else s for t, s in zip(tensors, static)]
        # the warm-up runs the program: inputs it writes get scratch copies, so the call's one
        # write is the replay's (a counter's add_ would otherwise count twice)
        written = set(getattr(runner, "written", ()))
        warm = [t.clone() if i in written else t for i, t in enumerate(inputs)]
        side = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        # one split-K workspace for the graph's GEMMs, allocated in the warm-up, kept by its replay
        arena = gemm.Workspace()
        if hasattr(runner, "gemm_workspace"):
            arena.reserve(device.index if device.index is not None else torch.cuda.current_device(),
                          *runner.gemm_workspace())
        with torch.cuda.stream(side), gemm.capturing(arena):
            runner.run(warm)  # first use of cuBLAS workspaces etc. on this stream happens outside the capture
        current.wait_stream(side)
        del warm
        graph = torch.cuda.CUDAGraph()
        # capture_begin/capture_end, not `torch.cuda.graph`: its entry synchronizes the device,
        # runs a full gc.collect() and empties the allocator's cache, ~10 ms a capture with a
        # transformers model loaded (bench/LOG_blocks.md, session 35), once per decode size. The
        # collector is held off instead, so no finalizer runs inside the capture; the cache is
        # emptied only where the device is short of memory (`release_if_tight`).
        release_if_tight(device)
        with collector.paused():
            with torch.cuda.stream(side), gemm.capturing(arena):
                side.wait_stream(current)
                before = torch.cuda.memory_reserved(device)  # the graph's private pool is new segments
                graph.capture_begin()
                try:
                    outs = runner.run(inputs)
                except BaseException:
                    try:
                        graph.capture_end()
                    except Exception:  # the capture is invalid already; the program's error says why
                        pass
                    raise
                graph.capture_end()
                pool = torch.cuda.memory_reserved(device) - before

    def replay(graph=graph):
        graph.replay()

    replay.workspace = arena  # (the graph reads the arena's buffers: they live as long as it may replay)
    return replay, outs, static, max(pool, 0) + arena.nbytes()


# Calls an input must have lain at one address before a move counts as the caller replacing a
# kept buffer (read in place at its new address) rather than a tensor made fresh per call (copied).
# A move after a shorter stay marks the input volatile for good. Captures made for moves are
# also held to MOVE_CAPTURES + one per MOVE_CALLS calls: past that a moved buffer is copied
# (volatile), so a caller swapping buffers every SETTLED calls does not capture every SETTLED
# calls. (transformers' generate alternates two cache addresses, which two slots then serve.)
SETTLED = 8
MOVE_CAPTURES, MOVE_CALLS = 2, 64

TIGHT = 0.25  # of the device: below this much free to the driver, the cache is emptied before a capture


def release_if_tight(device, info=None, empty=None) -> bool:
    """Give the caching allocator's unused blocks back to the driver before a capture where the
    device has under TIGHT of its memory free: the graph's private pool takes new segments, and
    during a capture the allocator does not free cached blocks to make room for them, so a
    capture could fail for memory the process holds unused (`GraphMemory.room` counts it free).
    Returns whether it emptied the cache. `info`, `empty`: stand-ins for tests."""
    free, total = (info or torch.cuda.mem_get_info)(device)
    if free >= TIGHT * total:
        return False
    (empty or torch.cuda.empty_cache)()
    return True


class CudaStreams:
    """The caller's current stream on one device, as a raw handle (cheap, read every call), and a
    wait for the work queued so far on another stream seen before (rare: only on a switch)."""

    def __init__(self, device: torch.device):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.seen: dict[int, torch.cuda.Stream] = {}  # raw handle -> the torch stream behind it
        self.raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def current(self) -> int:
        handle = self.raw(self.index) if self.raw else torch.cuda.current_stream(self.index).cuda_stream
        if handle not in self.seen:
            self.seen[handle] = torch.cuda.current_stream(self.index)
        return handle

    def wait(self, handle: int) -> None:
        torch.cuda.current_stream(self.index).wait_stream(self.seen[handle])


class OneStream:
    """Stream bookkeeping for an emulated capture (CPU tests): everything runs in order."""

    def current(self) -> int:
        return 0

    def wait(self, handle: int) -> None:
        raise AssertionError("one stream never waits for another")


def _copy_all(dst: list, src: list) -> None:
    """dst[i].copy_(src[i]) for every i, in one call: a decode step copies each layer's cache
    and length into its slot (49 copies a step at 16 layers, ~4 us of host time each)."""
    if len(dst) == 1:
        dst[0].copy_(src[0])
    else:
        torch._foreach_copy_(dst, src)


def _storage_key(t) -> int:
    return t.untyped_storage()._cdata


class Graphed:
    """A runner behind CUDA-graph slots: the first call warms up, later calls replay."""

    def __init__(self, runner, max_slots: int = 2, clone: bool = False, capture=capture_cuda, capturing=None,
                 streams=None, memory: GraphMemory | None = None):
        self.runner = runner
        self.memory = memory or MEMORY
        cuda = capture is capture_cuda and runner.device.type == "cuda"
        self.streams = streams or (CudaStreams(runner.device) if cuda else OneStream())
        # a caller capturing its own CUDA graph gets the thin path, recorded into its graph
        self.capturing = capturing or (torch.cuda.is_current_stream_capturing if capture is capture_cuda
                                       else (lambda: False))
        self.max_slots = max_slots
        self.clone = clone or _use_count is None
        self.capture = capture
        self.slots: list[Slot] = []
        self.last = None          # input addresses of the previous call (None where not contiguous)
        self.calls = 0                   # calls seen by `_track`
        self.arrived: list[int] = []     # per input: the call that first passed its present address
        self.moved: set[int] = set()     # inputs this call passes at a new address after a settled stay
        self.move_captures = 0           # captures made for such moves
        self.volatile: set[int] = set()  # inputs seen at another address than a direct slot's: copied
        self.written = tuple(getattr(runner, "written", ()))  # inputs the program writes in place
        self.warm = False
        self.off: str | None = None
        self.stats = {"warmup": 0, "captures": 0, "replays": 0, "copies": 0, "copied_bytes": 0, "thin": 0,
                      "stream_waits": 0, "evictions": 0, "over_budget": 0}

    def __call__(self, tensors) -> list:
        if self.off is not None or self.capturing():
            self.stats["thin"] += 1
            return self.runner.run(tensors)
        ptrs = tuple([t.data_ptr() if t.is_contiguous() else None for t in tensors])
        self._track(ptrs)
        if not self.warm:
            self.warm, self.last = True, ptrs
            self.stats["warmup"] += 1
            token = FIRST_CALL.set(True)
            try:
                return self.runner.run(tensors)
            finally:
                FIRST_CALL.reset(token)
        stream = self.streams.current()
        slot = self._find(ptrs)
        if slot is not None and slot.stream is not None and slot.stream != stream:
            self.streams.wait(slot.stream)  # its last replay, and what read its results there, come first
            self.stats["stream_waits"] += 1
        if slot is not None:
            dst = [s for s in slot.inputs if s is not None]
            if dst:
                _copy_all(dst, [t for s, t in zip(slot.inputs, tensors) if s is not None])
                self.stats["copies"] += 1
                self.stats["copied_bytes"] += slot.copy_bytes
        else:
            if not self._room() or (len(self.slots) >= self.max_slots and not self._evict(ptrs)):
                self.last = ptrs
                self.stats["thin"] += 1
                return self.runner.run(tensors)
            direct = tuple([p is not None and (p == q or i in self.moved) and i not in self.volatile
                            for i, (p, q) in enumerate(zip(ptrs, self.last or ()))])
            direct += (False,) * (len(tensors) - len(direct))
            slot = self._capture(tensors, direct)
            if slot is None:
                return self.runner.run(tensors)
            if self.moved:
                self.move_captures += 1
        self.last = ptrs
        slot.replay()
        back = [i for i in self.written if slot.inputs[i] is not None]  # copied inputs it writes: to the caller's
        if back:
            _copy_all([tensors[i] for i in back], [slot.inputs[i] for i in back])
        slot.stream = stream
        self.stats["replays"] += 1
        return slot.results(self.clone)

    def _find(self, ptrs) -> Slot | None:
        """A free slot whose direct inputs lie at these addresses, the one copying least. An input
        that moved since the last call to another address than a slot's direct one is marked
        volatile (later captures copy it), unless it is a replaced buffer (`moved`); a slot left
        stale by one marks nothing on the calls after."""
        best = None
        last = self.last or (None,) * len(ptrs)
        for s in self.slots:
            if not s.fits(ptrs):
                self.volatile.update(i for i, (p, q, r) in enumerate(zip(s.ptrs, ptrs, last))
                                     if p is not None and p != q and q != r and i not in self.moved)
            elif s.free() and (best is None or s.copies() < best.copies()):
                best = s
        return best

    def _track(self, ptrs) -> None:
        """Note where each input's present address began; `moved`: those at a new address after
        SETTLED or more calls at the old (a kept buffer replaced), unless already volatile."""
        self.calls += 1
        if self.moved:
            self.moved = set()
        if self.last is None or len(self.arrived) != len(ptrs):
            self.arrived = [self.calls] * len(ptrs)
            return
        if ptrs == self.last and None not in ptrs:  # (every input where it was: nothing to note)
            return
        budget = self.move_captures < MOVE_CAPTURES + self.calls // MOVE_CALLS
        for i, (p, q) in enumerate(zip(ptrs, self.last)):
            if p is None or p != q:
                settled = self.calls - self.arrived[i] >= SETTLED
                if budget and settled and p is not None and q is not None and i not in self.volatile:
                    self.moved.add(i)
                self.arrived[i] = self.calls

    def _evict(self, ptrs) -> bool:
        """All slots taken: drop a free one whose direct inputs are not at this call's addresses
        (a volatile input's, or a replaced buffer's old one: unlikely to fit again) to make room;
        False if there is none."""
        for s in self.slots:
            if s.free() and not s.fits(ptrs):
                self.slots.remove(s)
                self.stats["evictions"] += 1
                return True
        return False

    def _room(self) -> bool:
        """The process's CUDA-graph memory has room for another slot (GraphMemory)."""
        if self.memory.room(self.runner.device):
            return True
        self.stats["over_budget"] += 1
        if not self.memory.warned:
            self.memory.warned = True
            warnings.warn(f"tilefuse: new shapes run without CUDA graphs from here on: "
                          f"{self.memory.why_full(self.runner.device)}", RuntimeWarning, stacklevel=4)
        return False

    def _capture(self, tensors, direct) -> Slot | None:
        try:
            replay, outs, static, pool = self.capture(self.runner, tensors, direct)
            ptrs = tuple(t.data_ptr() if d else None for t, d in zip(tensors, direct))
            slot = self._slot(replay, outs, static, ptrs, tensors)
        except NotGraphable as e:
            self.off = str(e)
            return None
        except Exception as e:  # noqa: BLE001 - any failure means: run without graphs, and say why
            self.off = f"capture failed: {type(e).__name__}: {e}"
            warnings.warn(f"tilefuse: CUDA graphs off for this program ({self.off})", RuntimeWarning, stacklevel=3)
            return None
        self.memory.take(self.runner.device, pool + sum(b.numel() * b.element_size() for b in static if b is not None),
                         slot)
        self.slots.append(slot)
        self.stats["captures"] += 1
        return slot

    def _slot(self, replay, outs, static, ptrs, tensors) -> Slot:
        read = {_storage_key(s if s is not None else t) for s, t in zip(static, tensors)}
        fixed = {_storage_key(t) for t in self.runner.prefilled()}
        private, storages, seen = [], [], set()
        for o in outs:
            key = _storage_key(o)
            if key in read:
                raise NotGraphable("an output views an input, so a replay would return the capture's buffer")
            private.append(key not in fixed)
            if key not in fixed and key not in seen:
                seen.add(key)
                storages.append(o.untyped_storage())
        slot = Slot(replay, list(outs), tuple(private), list(static), ptrs, storages)
        nbytes = [0 if b is None else b.numel() * b.element_size() for b in static]
        slot.copy_bytes = sum(nbytes) + sum(nbytes[i] for i in self.written if i < len(nbytes))
        slot.settle()
        return slot
