"""Which schedule a kernel gets: tuned knobs from the cache, else the family's heuristic default.

`tuned_schedule` is the hook the compiled program calls for each kernel it compiles
(compiler.py passes it to Program); `choose` also says where the knobs came from, for
`tilefuse compile --ir schedule`. A lookup never fails a compilation: no GPU, another
target architecture, a family without a tuner, a cache miss, knobs that no longer render,
or TILEFUSE_TUNED=0 all mean the heuristic default, with a note saying which.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import env


@dataclass(frozen=True)
class Choice:
    schedule: object       # None: the family's default (it had no tuner)
    tuned: bool
    note: str              # where the knobs came from, one line
    entry: object = None   # the cache entry, when tuned


def choose(kernel, arch: str | None = None, device_index: int | None = None, cache=None, *,
           build_default: bool = True) -> Choice:
    """`build_default=False`: where nothing tuned applies, the Choice's schedule is None rather than
    the default built, which the compile hooks would drop (its knob space built and checked:
    0.4-0.6 ms a kernel, 15-22 ms for the 34 kernels of a 4-layer Llama, at every size)."""
    from ..runtime.nvrtc import normalize_arch
    from .cache import TuneCache, key_for
    from .device import cuda_device
    from .families import get_family

    try:
        fam = get_family(kernel.family)
    except ValueError:
        return Choice(None, False, f"heuristic default (no tuner for the {kernel.family} family)")
    device = cuda_device(device_index or 0)
    target = normalize_arch(arch) if arch else (device.arch if device else "sm_90a")

    def default(why: str) -> Choice:
        if not build_default:
            return Choice(None, False, f"heuristic default ({why})")
        space = fam.space(kernel, target)
        return Choice(fam.build(kernel, space.as_dict(space.default), target), False, f"heuristic default ({why})")

    if not env.switch("TILEFUSE_TUNED"):
        return default("TILEFUSE_TUNED=0")
    if device is None:
        return default("no GPU here; tuned knobs are per GPU")
    if target != device.arch:
        return default(f"building for {target}; tuned knobs are for this {device.arch} GPU")
    entry = (cache or TuneCache()).get(key_for(kernel, device, fam))
    if entry is None:
        return default(f"not tuned for {device.name}; `tilefuse tune` measures it")
    try:
        space = fam.space(kernel, target)
        if not space.valid(entry.knobs):
            raise ValueError("the code generator rejects them")
        schedule = fam.build(kernel, entry.knobs, target)
    except (ValueError, KeyError, TypeError) as e:
        return default(f"cached knobs no longer valid: {e}")
    st = entry.stats
    gain = f", {st['default_us'] / st['median_us']:.2f}x the default's speed" if st.get("default_us") else ""
    return Choice(schedule, True, f"tuned (cache hit: {st.get('median_us', float('nan')):.1f} us{gain})", entry)


def tuned_schedule(kernel, arch, device):
    """The Program hook: tuned knobs for `kernel` on `device` (a torch.device), or None
    (the compiler's heuristic default)."""
    index = getattr(device, "index", None)
    choice = choose(kernel, arch, index, build_default=False)
    return choice.schedule if choice.tuned else None


def choose_gemm(problem, arch: str | None = None, device_index: int | None = None, cache=None, *,
                build_default: bool = True) -> Choice:
    """`choose` for a GEMM (codegen.gemm_sm90.GemmProblem, epilogue included): the tuned
    GemmSchedule or `default_schedule`'s, with a note saying which and why."""
    from .gemm import GemmTask

    return choose(GemmTask(problem), arch, device_index, cache, build_default=build_default)


def tuned_gemm_schedule(problem, arch: str | None = None, device=None):
    """For the fusion planner: the tuned GemmSchedule of `problem` on `device` (a
    torch.device, a CUDA index, or None for device 0), or None when there is none (not
    tuned on this GPU model and toolkit, another `arch`, no GPU, TILEFUSE_TUNED=0, or
    knobs the current template rejects); then use `default_schedule(problem)`.

        sched = tuned_gemm_schedule(problem, "sm_90a", x.device) or default_schedule(problem)
        gemm = compile_gemm(problem, sched)

    Problems equal up to names (the epilogue's buffers and values) share one entry. A
    lookup reads one SQLite row (well under a millisecond warm) and never raises."""
    index = device if isinstance(device, int) else getattr(device, "index", None)
    choice = choose_gemm(problem, arch, index, build_default=False)
    return choice.schedule if choice.tuned else None
