"""Timing a compiled program next to its baselines, in one run, as the performance method says.

Times are medians of CUDA-event timings, L2 flushed before each call by reading a buffer
larger than it (`median_ms`; do_bench's flush writes one, and the write-back of its dirty
lines lands in the timed call: about 9 us, 10%, of a cross-entropy that reads 268 MB on an
H100, bench/LOG.md). Bytes are the program's unavoidable traffic: every input and weight read
once, every output written once. The copy ceiling is a device-to-device copy measured in
the same run, counting bytes read plus bytes written.

Matrix-bound programs are timed differently. Large bf16 GEMMs hold an H100 at its power limit,
where the SM clock falls from 1980 MHz to ~1.5 GHz within a few hundred ms, and how far it falls
depends on the energy the work takes. A short timing window right after another implementation
inherits that one's clock (and a rotated order of three keeps who follows whom). So each such
implementation first runs back to back on its own (`settle`), and `sustained_ms` times it in
continuous use, as a serving or training loop runs it: events around back-to-back calls, no flush
(the weights of such a program are far larger than L2 anyway). bench/LOG_blocks.md, session 23.

Host overhead is the other half of a small program's time: the wall time of one Python
call with the GPU idle (synchronize, then time the call until it returns, median). When
it exceeds the GPU time, a loop of calls is bound by the host, whatever the kernels do.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch


FLUSH_BYTES = 256 << 20   # more than any L2 so far (H100: 50 MB)
_flush_buf = {}


def _read_flush():
    """Evict L2 by reading a buffer larger than it. do_bench's flush writes one instead, and
    the dirty lines it leaves are written back to DRAM while the timed kernel runs: about
    10 us taken from a kernel that only reads (bench/LOG.md, session 5)."""
    dev = torch.cuda.current_device()
    if dev not in _flush_buf:
        _flush_buf[dev] = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    buf = _flush_buf[dev]
    return lambda: torch.amax(buf)


def timings_ms(fn, warmup: int = 25, rep: int = 100, flush: str = "read") -> list[float]:
    """Each timed call of `fn` in ms, CUDA events around each call, L2 flushed before each one:
    flush="read" reads 256 MB (clean lines: no write-back lands in the timed call);
    "write" is triton's do_bench (zeroes 256 MB); "none" times back-to-back calls.
    `warmup` and `rep` are in ms, as do_bench takes them."""
    if flush == "write":
        from triton.testing import do_bench

        return [float(t) for t in do_bench(fn, warmup=warmup, rep=rep, return_mode="all")]
    if flush not in ("read", "none"):
        raise ValueError(f"flush must be 'write', 'read' or 'none', not {flush!r}")
    clear = _read_flush() if flush == "read" else (lambda: None)
    clear()  # the flush kernel's first launch (its module load) is not one to size the loops by
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        clear()
        fn()
    b.record()
    torch.cuda.synchronize()
    per = max(a.elapsed_time(b) / 5, 1e-3)  # ms per (flush + call): sizes the loops
    for _ in range(max(1, int(warmup / per))):
        clear()
        fn()
    n = max(5, int(rep / per))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in ev:
        clear()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in ev]


def settle(fn, seconds: float, chunk: float = 0.1) -> None:
    """Run `fn` back to back for `seconds` of wall time: afterwards the GPU's clock is the steady
    one this work holds it at. A first call is made and not counted (a compiled program captures
    its CUDA graph on an early call, several times slower than a replay: sizing the loop by it cut
    a 1 s settle to 0.2 s); then calls are queued in chunks of about `chunk` seconds, each sized by
    one call, with a sync between chunks only (the GPU idles for one launch, not between calls)."""
    if seconds <= 0:
        return
    fn()
    torch.cuda.synchronize()
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        per = max(time.perf_counter() - t0, 1e-5)
        for _ in range(int(min(chunk, left) / per)):
            fn()
        torch.cuda.synchronize()


def sustained_ms(fn, seconds: float = 0.5, settle_s: float = 1.0) -> float:
    """ms per call of `fn` in continuous use: `settle_s` back to back first, then CUDA events
    around back-to-back calls for about `seconds` (at least 5 calls)."""
    if settle_s > 0:
        settle(fn, settle_s)
    else:
        fn()  # a first call is no measure of the next ones (see settle)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return back_to_back_ms(fn, max(5, int(seconds / max(time.perf_counter() - t0, 1e-5))))


def back_to_back_ms(fn, n: int) -> float:
    """ms per call of `fn` over `n` calls queued back to back between two CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def median_ms(fn, warmup: int = 25, rep: int = 100, flush: str = "read") -> float:
    """The median of `timings_ms` (see there for `flush`)."""
    return float(statistics.median(timings_ms(fn, warmup, rep, flush)))


def host_us(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median host time of one call, in microseconds, each started with the GPU idle."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy rate in bytes/s (read + write)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def program_bytes(graph) -> int:
    return (sum(graph[i].type.nbytes for i in graph.inputs) + sum(graph[w].type.nbytes for w in graph.weights)
            + sum(graph[o].type.nbytes for o in set(graph.outputs)))


@dataclass
class Row:
    name: str
    ms: float
    gbps: float
    pct_copy: float
    vs_tilefuse: float  # this time / tilefuse's time (> 1: tilefuse is faster)
    host_us: float = float("nan")  # host time of one call with the GPU idle


def fresh_compile(fn, **kwargs):
    """torch.compile(fn, **kwargs) on a fresh dynamo, as a user compiling once at these sizes
    gets it: after an earlier call of the same code at other sizes (a benchmark's previous case
    of the same module class, or of the same lambda) dynamo would recompile it with dynamic
    shapes (automatic dynamic), a slower baseline than the program it is timed against.
    (Resetting drops the caches of what was compiled before: compile, time, then the next.)"""
    torch._dynamo.reset()
    return torch.compile(fn, **kwargs)


def compare(prog, module, inputs, nbytes: int, copy_bps: float | None = None, with_compile=True,
            extra: dict | None = None, rounds: int = 1, sustained: bool = False) -> list[Row]:
    """Time tilefuse, eager, torch.compile (and any `extra` named callables) in this run.

    rounds > 1: each implementation is timed once per round, the order rotated from round to
    round, and its time is the median of its rounds (a 13 us kernel's one-off median moves by
    a few % with the GPU's state; interleaving puts the baselines through the same states).
    sustained: each timing is `sustained_ms` (its own steady clock, back to back) instead of the
    median of single calls with L2 flushed: for matrix-bound programs (see the module's note)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    timed = sustained_ms if sustained else median_ms
    copy_bps = copy_bps or copy_bandwidth()
    runs = {"tilefuse": lambda: prog(*inputs)}
    with torch.no_grad():
        runs["eager"] = lambda: module(*inputs)
        if with_compile:
            compiled = fresh_compile(module)
            compiled(*inputs)
            runs["torch.compile"] = lambda: compiled(*inputs)
        runs.update(extra or {})
        names = list(runs)
        per: dict = {k: [] for k in names}
        for i in range(rounds):
            for k in names[i % len(names):] + names[:i % len(names)]:
                per[k].append(timed(runs[k]))
        times = {k: float(statistics.median(per[k])) for k in names}
        hosts = {k: host_us(f) for k, f in runs.items()}
    base = times["tilefuse"]
    return [Row(k, t, nbytes / (t * 1e-3) / 1e9, 100 * nbytes / (t * 1e-3) / copy_bps, t / base, hosts[k])
            for k, t in times.items()]


def bench_program(prog, module, inputs, stages):
    from rich.table import Table

    copy_bps = copy_bandwidth()
    flops, nbytes = program_flops(stages.plan), program_bytes(stages.graph)
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    sustained = sustained_timing(flops, nbytes, l2)
    rows = compare(prog, module, inputs, nbytes, copy_bps, sustained=sustained)
    how = ("ms per call back to back, each after 1 s of its own calls (the GPU's steady clock)" if sustained
           else "median of single calls, L2 flushed before each")
    table = Table(title=f"{torch.cuda.get_device_name()}: copy {copy_bps / 1e12:.2f} TB/s; {how}",
                  caption="host: one call's Python time with the GPU idle; above the GPU time, a loop is host-bound"
                          + _graph_note(prog))
    cols = ["impl", "time (us)", "GB/s", "% of copy"] + (["TFLOP/s"] if flops else []) + ["time / tilefuse",
                                                                                         "host us/call"]
    for col in cols:
        table.add_column(col)
    for r in rows:
        bound = " (host-bound)" if r.host_us > r.ms * 1e3 else ""
        rate = [f"{flops / (r.ms * 1e-3) / 1e12:.0f}"] if flops else []
        table.add_row(r.name, f"{r.ms * 1e3:.1f}", f"{r.gbps:.0f}", f"{r.pct_copy:.0f}%", *rate,
                      f"{r.vs_tilefuse:.2f}x", f"{r.host_us:.1f}{bound}")
    return table


MATRIX_BOUND_FLOP_PER_BYTE = 100  # an H100's ridge is ~250 (764 TFLOP/s over 3.0 TB/s); past 100 its
                                  # tensor cores are busy enough to hold it near its power limit


def sustained_timing(flops: int, nbytes: int, l2_bytes: int) -> bool:
    """Time back to back at the steady clock (`sustained_ms`) a matrix-bound program (at least
    MATRIX_BOUND_FLOP_PER_BYTE) whose data cannot stay in L2 from one call to the next (twice
    the L2 or more); else single calls with L2 flushed, so that no call finds the last one's data
    there (a memory-bound program does not draw the power that moves the clock)."""
    return nbytes >= 2 * l2_bytes and flops >= MATRIX_BOUND_FLOP_PER_BYTE * nbytes


def program_flops(plan) -> int:
    """The matrix products' FLOPs (2 M N K each), generated GEMMs and cuBLAS externs alike: a
    program with them is compute-bound, and its rate says more than its bytes."""
    return sum(s.flops for s in plan.steps)


def _graph_note(prog) -> str:
    info = prog.graph_info() if hasattr(prog, "graph_info") else []
    if not info:
        return "; tilefuse: CUDA graphs off"
    i = info[-1]
    return ("; tilefuse: CUDA graph replay" if i["graphs"] else f"; tilefuse: no CUDA graph ({i['reason']})")


def as_dicts(rows):
    return [asdict(r) for r in rows]
