#!/usr/bin/env bash
# Session 58's measurements of map kernels walked as rows of K of the whole tensor (loop/flat.py:
# maps alone over rows shorter than 64) on the GPU machine,
# from the repository root, one device call (~2 minutes): `tilefuse run --bench` (tilefuse, eager
# and torch.compile in one process; bf16), and each case tagged _rows with TILEFUSE_FLAT_ROWS=0
# (the kernel's own rows, as before). The rows of 98 and 1001 were walked flat when this ran
# first (session 58: rows whose bytes are no multiple of 16 too) and measured slower; they keep
# their rows now, so their pairs are equal. Text under $OUT (or ./flat_rows); a line a run on stdout.
# ONLY=REGEX runs the cases whose tag matches.
#
#     bash bench/flat_rows.sh
set -u
out=${OUT:-flat_rows}
mkdir -p "$out"
while IFS='|' read -r tag flat expr; do
  [ -z "$tag" ] && continue
  [ -n "${ONLY:-}" ] && ! [[ $tag =~ $ONLY ]] && continue
  TILEFUSE_FLAT_ROWS=$flat PYTHONPATH=$PWD/src:${PYTHONPATH:-} timeout 150 python3 -m tilefuse.cli run --dtype bf16 \
    --bench --seed 1 -c "$expr" > "$out/$tag.txt" 2>&1
  echo "$tag: $(grep -E '^│ (tilefuse|eager|torch.compile)' "$out/$tag.txt" | tr -s ' ' | tr '\n' ' ')"
done <<'CASES'
gate_14x14|1|(lambda x, s: x * torch.sigmoid(s))(torch.randn(128,512,14,14), torch.randn(128,512,1,1))
gate_14x14_rows|0|(lambda x, s: x * torch.sigmoid(s))(torch.randn(128,512,14,14), torch.randn(128,512,1,1))
gate_7x7|1|(lambda x, s: x * torch.sigmoid(s))(torch.randn(128,2048,7,7), torch.randn(128,2048,1,1))
gate_7x7_rows|0|(lambda x, s: x * torch.sigmoid(s))(torch.randn(128,2048,7,7), torch.randn(128,2048,1,1))
bias_gelu_98|1|(lambda x, b: F.gelu(x + b))(torch.randn(262144,98), torch.randn(98))
bias_gelu_98_rows|0|(lambda x, b: F.gelu(x + b))(torch.randn(262144,98), torch.randn(98))
scale_1001|1|(lambda x, s: x * s)(torch.randn(8192,1001), torch.randn(8192,1))
scale_1001_rows|0|(lambda x, s: x * s)(torch.randn(8192,1001), torch.randn(8192,1))
CASES
