"""Fuzz: random programs (programs.py) compiled by tilefuse, judged against eager on the same
device (judge.py). Each finding is written to OUTDIR as `{bad,crash,timeout}_SEED.txt`: the
program (factories placed on the device), its inputs' shapes and dtypes, and what differed.

usage: python fuzz/run.py START COUNT OUTDIR [big]
  FUZZ_DEVICE=cuda (default) or cpu (the interpreter); FUZZ_SECONDS stops it after that long;
  FUZZ_BACKEND=1 runs each program under torch.compile(backend="tilefuse"), called three times;
  FUZZ_BACKEND=sizes under it too, at the example's sizes and then at two others (one dim size
  changed in every input that has it), then at the first sizes again, each later call judged."""
import sys, os, random, time, math, signal, re, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.nn.functional as F
import programs
from judge import check, check_sizes
from programs import Gen, make_input, other_sizes

FACT = ("tensor", "linspace", "arange", "zeros", "ones", "full", "randn", "rand")

def on_device(src):
    """Add device=DEV to every torch factory call in the source."""
    out, i = [], 0
    pat = re.compile(r"torch\.(%s)\(" % "|".join(FACT))
    while True:
        m = pat.search(src, i)
        if not m:
            out.append(src[i:]); break
        out.append(src[i:m.end()])
        depth, j = 1, m.end()
        while depth:
            c = src[j]
            depth += c in "([{"
            depth -= c in ")]}"
            j += 1
        inner = on_device(src[m.end():j - 1])
        out.append(inner + ", device=DEV)")
        i = j
    return "".join(out)

DEVICE = torch.device(os.environ.get("FUZZ_DEVICE", "cuda"))
SIZES = os.environ.get("FUZZ_BACKEND") == "sizes"
start, count, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
big = len(sys.argv) > 4 and sys.argv[4] == "big"
programs.BIG = big
programs.MAXN = 2_000_000 if big else 20000
os.makedirs(outdir, exist_ok=True)
stats = {}
class TO(Exception): pass
def handler(*a): raise TO()
signal.signal(signal.SIGALRM, handler)
t_end = time.time() + float(os.environ.get("FUZZ_SECONDS", "1e9"))
def save_stats(last):
    """The counts so far and the seed being judged: a process killed mid-run (the host's
    out-of-memory killer took one in session 79) leaves both, naming the seed that killed it."""
    json.dump({**stats, "at": last}, open(f"{outdir}/stats_{start}.json", "w"))

for seed in range(start, start + count):
    if time.time() > t_end: break
    save_stats(seed)
    g = Gen(seed)
    signal.alarm(30)
    try:
        src = g.build()
    except Exception:
        src = None
    except TO:
        src = None
    signal.alarm(0)
    if src is None: continue
    dsrc = on_device(src)
    ns = {"torch": torch, "F": F, "math": math, "DEV": DEVICE}
    exec(dsrc, ns)
    fn = ns["f"]
    example = [g.env[n].to(DEVICE) for n in g.args]
    rr = random.Random(seed * 7 + 1)
    fresh = [make_input(rr, tuple(x.shape), str(x.dtype)).to(DEVICE) for x in example]
    signal.alarm(90)
    try:
        fl = [v.dtype for v in g.env.values() if v.is_floating_point()]
        coarse = max(fl, key=lambda d: {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}[d]) if fl else None
        if SIZES:
            others = other_sizes(example, rr, DEVICE)
            st, msg = ("skip", "no dim above 1") if others is None else check_sizes(fn, example, others, coarse=coarse)
        else:
            st, msg = check(fn, example, fresh, coarse=coarse, backend=os.environ.get("FUZZ_BACKEND") == "1")
    except TO:
        st, msg = "timeout", ""
    except Exception as ex:
        st, msg = "harness", repr(ex)[:300]
    signal.alarm(0)
    stats[st] = stats.get(st, 0) + 1
    if st in ("bad", "crash", "timeout", "harness"):
        with open(f"{outdir}/{st}_{seed}.txt", "w") as fh:
            fh.write(dsrc + f"\n# mode: {'big' if big else 'small'}" + (" sizes" if SIZES else "") + "\n# inputs: " + repr([(tuple(x.shape), str(x.dtype)) for x in example]) + "\n# " + msg.replace("\n", "\n# ") + "\n")
    elif st == "skip":
        with open(f"{outdir}/skips.log", "a") as fh:
            fh.write(f"{seed}: {msg[:200]}\n")
json.dump(stats, open(f"{outdir}/stats_{start}.json", "w"))  # (no "at": the run ended)
print(start, stats, flush=True)
