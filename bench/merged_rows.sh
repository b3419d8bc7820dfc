#!/usr/bin/env bash
# Session 59's measurements of loop/flat.py's merged rows on the GPU machine, from the repository
# root, one device call (~4 minutes): each map kernel's time (bench/kernel_times.py: tilefuse,
# eager and torch.compile in one process), then tilefuse's with merged rows off
# (TILEFUSE_MERGED_ROWS=0: the rows of the last dim, or the flat walk where they are short).
# JSON and text under $OUT (or ./merged_rows); a line a case on stdout. ONLY=REGEX picks cases.
set -u
out=${OUT:-merged_rows}
mkdir -p "$out"
while IFS='|' read -r tag dtype expr; do
  [ -z "$tag" ] && continue
  [ -n "${ONLY:-}" ] && ! [[ $tag =~ $ONLY ]] && continue
  timeout 120 python3 bench/kernel_times.py --dtype "$dtype" --json "$out/$tag.json" -c "$expr" > "$out/$tag.txt" 2>&1
  TILEFUSE_MERGED_ROWS=0 timeout 60 python3 bench/kernel_times.py --dtype "$dtype" --impls tilefuse \
    --json "$out/${tag}_off.json" -c "$expr" > "$out/${tag}_off.txt" 2>&1
  echo "$tag: $(grep -h 'us in kernels' "$out/$tag.txt" | tr -s ' ' | tr '\n' ' ') | off: $(grep -h 'us in kernels' "$out/${tag}_off.txt" | tr -s ' ')"
done <<'CASES'
bn_relu|bf16|F.relu(nn.BatchNorm2d(64).eval()(torch.randn(32,64,112,112)))
chan_112|bf16|torch.relu(torch.randn(32,64,112,112)*torch.randn(64,1,1)+torch.randn(64,1,1))
chan_28|bf16|torch.relu(torch.randn(128,256,28,28)*torch.randn(256,1,1)+torch.randn(256,1,1))
chan_56_f32|f32|torch.relu(torch.randn(32,128,56,56)*torch.randn(128,1,1)+torch.randn(128,1,1))
gate_14|bf16|(lambda x, s: x * s)(torch.randn(128,512,14,14), torch.randn(128,512,1,1))
gate_14_f32|f32|(lambda x, s: x * s)(torch.randn(128,512,14,14), torch.randn(128,512,1,1))
gn_silu|bf16|F.silu(nn.GroupNorm(32,320)(torch.randn(2,320,128,128)))
scale_112|bf16|torch.randn(64,96,112,112)*2
gelu_98|bf16|F.gelu(torch.randn(8192,98,98)+torch.randn(98))
scale_1001|bf16|torch.randn(4096,1001)*3
CASES
