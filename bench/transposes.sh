#!/usr/bin/env bash
# Session 56's measurements of codegen/tiles.py on the GPU machine, from the repository root, one
# device call (~4 minutes): maps around a permute that moves the last dim, `tilefuse run --bench`
# (tilefuse, eager and torch.compile in one process; bf16 unless named), and the first case in the
# tree at $OLD too (a `git archive REV src` extracted there; default .old/head): there the map ran
# as a row kernel and PyTorch copied its result transposed.
# Text under $OUT (or ./transposes); a line a run on stdout. ONLY=REGEX runs the cases whose tag matches.
#
#     git archive 0a89154 src | tar x -C .old/head && bash bench/transposes.sh
set -u
out=${OUT:-transposes}
old=${OLD:-$PWD/.old/head}/src
mkdir -p "$out"
while IFS='|' read -r tag dtype src expr; do
  [ -z "$tag" ] && continue
  [ -n "${ONLY:-}" ] && ! [[ $tag =~ $ONLY ]] && continue
  path=$PWD/src; [ "$src" = old ] && path=$old
  PYTHONPATH=$path:${PYTHONPATH:-} timeout 150 python3 -m tilefuse.cli run --dtype "$dtype" --bench --seed 1 -c "$expr" \
    > "$out/$tag.txt" 2>&1
  echo "$tag: $(grep -E '^│ (tilefuse|eager|torch.compile)' "$out/$tag.txt" | tr -s ' ' | tr '\n' ' ')"
done <<'CASES'
map_then_transpose|bf16|new|(torch.randn(64,4096,256)*2+1).transpose(1,2).contiguous()
map_then_transpose_old|bf16|old|(torch.randn(64,4096,256)*2+1).transpose(1,2).contiguous()
transpose_then_map|bf16|new|torch.sigmoid(torch.randn(64,4096,256).transpose(1,2).contiguous())*3
nchw_to_nhwc_gelu|bf16|new|F.gelu(torch.randn(32,128,56,56).permute(0,2,3,1)+torch.randn(128)).contiguous()
square_t|bf16|new|(torch.randn(8192,8192)*2).t().contiguous()
odd_1000|bf16|new|(torch.randn(8,1000,1000)*2+1).transpose(1,2).contiguous()
map_then_transpose_f32|f32|new|(torch.randn(64,4096,256)*2+1).transpose(1,2).contiguous()
copy|bf16|new|torch.randn(64,4096,256).transpose(1,2).contiguous()
copy_old|bf16|old|torch.randn(64,4096,256).transpose(1,2).contiguous()
softmax_then_transpose|bf16|new|torch.softmax(torch.randn(64,4096,256),-1).transpose(1,2).contiguous()
CASES
