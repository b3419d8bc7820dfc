#!/usr/bin/env bash
# Session 54's measurements of views read in place (fusion.views_read_in_place), on the GPU
# machine from the repository root, one device call (~3 minutes): transformers' rotate-half
# RoPE alone at one token and at 8192 (`tilefuse run --bench`: tilefuse, eager, torch.compile
# in one process), in this tree and in the tree at $OLD (a `git archive REV src` extracted
# there; default .old/base), then an HF Llama's static-cache decode (4 x 2048) with
# `bench/generate.py --step-times`, the two trees alternated, $PAIRS pairs (default 2), GEMV
# groups on in both. Text and JSON under $OUT (or ./views_ab); a line a run on stdout.
#
#     git archive cc7941a src | tar x -C .old/base && bash bench/views_ab.sh
set -u
out=${OUT:-views_ab}
old=${OLD:-$PWD/.old/base}/src
mkdir -p "$out"
P="(lambda q, c, s: (lambda t: t * c + torch.cat((-t[..., 64:], t[..., :64]), -1) * s)(q.transpose(1, 2)))"
for case in "prefill:torch.randn(1,8192,32,128), torch.randn(1,1,8192,128), torch.randn(1,1,8192,128)" \
            "decode:torch.randn(1,1,32,128), torch.randn(1,1,1,128), torch.randn(1,1,1,128)"; do
  name=${case%%:*}; ins=${case#*:}
  for tree in new old; do
    src=$PWD/src; [ $tree = old ] && src=$old
    PYTHONPATH=$src:${PYTHONPATH:-} timeout 100 python3 -m tilefuse.cli run --dtype bf16 --bench --seed 1 \
      -c "$P($ins)" > "$out/rope_${name}_$tree.txt" 2>&1
    echo "rope $name $tree: $(grep -E '^│ (tilefuse|torch.compile)' "$out/rope_${name}_$tree.txt" | tr -s ' ' | tr '\n' ' ')"
  done
done
for i in $(seq 1 "${PAIRS:-2}"); do
  for tree in new old; do
    src=$PWD/src; [ $tree = old ] && src=$old
    TILEFUSE_GEMV_GROUPS=1 TILEFUSE_SRC=$src timeout 110 python3 bench/generate.py --cache static --layers 4 \
      --hidden 2048 --prompt 128 --new 64 --modes tilefuse --repeats 3 --mask-skip --step-times \
      --json "$out/gen_${tree}_$i.json" > "$out/gen_${tree}_$i.txt" 2>&1
    echo "generate $tree $i: $(grep -E 'decode steps' "$out/gen_${tree}_$i.txt")"
  done
done
