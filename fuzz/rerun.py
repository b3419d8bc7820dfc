"""Judge saved findings again (after a fix, or on the other device): the inputs are drawn again
from the seed in the file's name, as run.py drew them.

usage: python fuzz/rerun.py cuda|cpu OUTDIR/bad_123.txt ...   """
import sys, os, random, math, re, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch.nn.functional as F
from judge import check, check_sizes
from programs import make_input, other_sizes
dev = torch.device(sys.argv[1])
for path in sys.argv[2:]:
    text = open(path).read()
    if "\n# inputs: " not in text:  # fuzz/gemm.py's findings name their args otherwise: rerun with it
        print(f"{path}: skipped (not run.py's finding; fuzz/gemm.py's are judged by the 2x rule already)", flush=True)
        continue
    src = text.split("\n# inputs:")[0]
    desc = eval(text.split("# inputs: ")[1].split("\n")[0])
    seed = int(re.findall(r"_(\d+)\.txt", path)[0])
    ns = {"torch": torch, "F": F, "math": math, "DEV": dev}
    exec(src, ns)
    # draw the inputs again, as run.py drew them
    import programs
    programs.BIG = "# mode: big" in text or os.path.basename(path).startswith("big_"); programs.MAXN = 2_000_000 if programs.BIG else 20000
    g = programs.Gen(seed); g.build()
    example = [g.env[n].to(dev) for n in g.args]
    rr = random.Random(seed * 7 + 1)
    fresh = [make_input(rr, tuple(x.shape), str(x.dtype)).to(dev) for x in example]
    fl = [v.dtype for v in g.env.values() if v.is_floating_point()]
    coarse = max(fl, key=lambda d: {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}[d]) if fl else None
    try:
        if "# mode: small sizes" in text or "# mode: big sizes" in text:  # FUZZ_BACKEND=sizes
            st, msg = check_sizes(ns["f"], example, other_sizes(example, rr, dev), coarse=coarse)
        else:
            st, msg = check(ns["f"], example, fresh, coarse=coarse)
    except Exception as ex:
        st, msg = "harness", repr(ex)[:200]
    print(f"{path}: {st} {msg.splitlines()[-1][:160] if msg else ''}", flush=True)
