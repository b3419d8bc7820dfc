#!/usr/bin/env bash
# Session 57's measurements of column kernels (codegen/columns.py: reductions over a dim that is
# not last, a row a thread) on the GPU machine, from the repository root, one device call (~3
# minutes): `tilefuse run --bench` (tilefuse, eager and torch.compile in one process; bf16 unless
# named), and each case tagged _off with column kernels off (TILEFUSE_COLUMNS=0: PyTorch's
# reductions and row kernels of the maps around them, what tilefuse ran before); then reductions
# over neighbouring dims (graph/rules/merged_reductions.py: before this session PyTorch's); last
# (session 58) the LayerNorm of NHWC read from NCHW (the permute copied in tiles, then a row kernel).
# Text under $OUT (or ./columns); a line a run on stdout. ONLY=REGEX runs the cases whose tag matches.
#
#     bash bench/columns.sh
set -u
out=${OUT:-columns}
mkdir -p "$out"
LN='(lambda x, w, b: w[:, None, None] * ((x - x.mean(1, keepdim=True)) / torch.sqrt((x - x.mean(1, keepdim=True)).pow(2).mean(1, keepdim=True) + 1e-6)) + b[:, None, None])'
while IFS='|' read -r tag dtype cols expr; do
  [ -z "$tag" ] && continue
  [ -n "${ONLY:-}" ] && ! [[ $tag =~ $ONLY ]] && continue
  expr=${expr//LN/$LN}
  TILEFUSE_COLUMNS=$cols PYTHONPATH=$PWD/src:${PYTHONPATH:-} timeout 150 python3 -m tilefuse.cli run --dtype "$dtype" \
    --bench --seed 1 -c "$expr" > "$out/$tag.txt" 2>&1
  echo "$tag: $(grep -E '^│ (tilefuse|eager|torch.compile)' "$out/$tag.txt" | tr -s ' ' | tr '\n' ' ')"
done <<'CASES'
softmax_dim1|bf16|1|torch.softmax(torch.randn(32,128,56,56),1)
softmax_dim1_off|bf16|0|torch.softmax(torch.randn(32,128,56,56),1)
layernorm_channels_first|bf16|1|LN(torch.randn(32,96,56,56),torch.randn(96),torch.randn(96))
layernorm_channels_first_off|bf16|0|LN(torch.randn(32,96,56,56),torch.randn(96),torch.randn(96))
layernorm_channels_first_f32|f32|1|LN(torch.randn(32,96,56,56),torch.randn(96),torch.randn(96))
mean_dim1|bf16|1|torch.randn(64,512,1024).mean(1)
mean_dim1_off|bf16|0|torch.randn(64,512,1024).mean(1)
amax_dim1|bf16|1|torch.randn(16,256,4096).amax(1)
softmax_dim1_64|bf16|1|torch.softmax(torch.randn(8,64,8192),1)
log_softmax_dim0|bf16|1|torch.log_softmax(torch.randn(1000,16384),0)
sum_dim0_few_rows|bf16|1|torch.randn(4096,1024).sum(0)
global_avg_pool|bf16|1|torch.randn(128,512,14,14).mean((2,3))
relu_global_avg_pool|bf16|1|torch.relu(torch.randn(128,512,14,14)).mean((2,3))
squeeze_excitation|bf16|1|(lambda x: x * torch.sigmoid(x.mean((2,3), keepdim=True)))(torch.randn(128,512,14,14))
sum_dims01|bf16|1|torch.randn(8,64,40000).sum((0,1))
nhwc_layernorm|bf16|1|F.layer_norm(torch.randn(32,96,56,56).permute(0,2,3,1),(96,))
CASES
