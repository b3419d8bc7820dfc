#!/usr/bin/env bash
# Session 60's measurements of few long rows split into pieces (loop/flat.py split_rows,
# rewrites.split_long_reductions) on the GPU machine, from the repository root, one device call
# (~3 minutes): each kernel's time (bench/kernel_times.py: tilefuse, eager and torch.compile in
# one process), then tilefuse's with the split off (TILEFUSE_SPLIT=0). JSON and text under $OUT
# (or ./split); a line a case on stdout. ONLY=REGEX picks cases.
set -u
out=${OUT:-split}
mkdir -p "$out"
while IFS='|' read -r tag dtype expr; do
  [ -z "$tag" ] && continue
  [ -n "${ONLY:-}" ] && ! [[ $tag =~ $ONLY ]] && continue
  timeout 120 python3 bench/kernel_times.py --dtype "$dtype" --json "$out/$tag.json" -c "$expr" > "$out/$tag.txt" 2>&1
  TILEFUSE_SPLIT=0 timeout 90 python3 bench/kernel_times.py --dtype "$dtype" --impls tilefuse \
    --json "$out/${tag}_off.json" -c "$expr" > "$out/${tag}_off.txt" 2>&1
  echo "$tag: $(grep -h 'us in kernels' "$out/$tag.txt" | tr -s ' ' | tr '\n' ' ') | off: $(grep -h 'us in kernels' "$out/${tag}_off.txt" | tr -s ' ')"
done <<'CASES'
map1d|f32|torch.expm1(torch.randn(16777216)*2+1)
gate4|f32|torch.sigmoid(torch.randn(4,4194304)*torch.randn(4,1))
sumsq|f32|(lambda x: (x*x).sum())(torch.randn(16777216))
norm|bf16|torch.linalg.vector_norm(torch.randn(4096,4096))
mse|bf16|F.mse_loss(torch.randn(4096,4096),torch.randn(4096,4096))
rowmax|bf16|torch.randn(3,4194304).amax(-1)
softmax1d|f32|torch.softmax(torch.randn(1048576),0)
CASES
