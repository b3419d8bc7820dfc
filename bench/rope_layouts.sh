#!/usr/bin/env bash
# Session 55's measurements of rules/permute_sink.py on the GPU machine, from the repository
# root, one device call (~5 minutes): transformers' rotate-half RoPE on q laid out [B, S, H, D]
# at three shapes, `tilefuse run --bench` (tilefuse and torch.compile in one process), as
#   A  returned as it is (eager lays it out as q: [B, S, H, D] in memory, a permuted view),
#   B  .contiguous() ([B, H, S, D] in memory: the kernel reads q through the transpose),
#   C  .transpose(1, 2).contiguous() (back to q's order, contiguous),
# A and C also in the tree at $OLD (a `git archive REV src` extracted there; default .old/head).
# Text under $OUT (or ./rope_layouts); a line a run on stdout.
#
#     git archive 0a89154 src | tar x -C .old/head && bash bench/rope_layouts.sh
set -u
out=${OUT:-rope_layouts}
old=${OLD:-$PWD/.old/head}/src
mkdir -p "$out"
P="(lambda q, c, s: (lambda t: t * c + torch.cat((-t[..., 64:], t[..., :64]), -1) * s)(q.transpose(1, 2)))"
for sh in "1,8192,32,128:1,1,8192,128" "4,2048,32,128:1,1,2048,128" "1,8192,8,128:1,1,8192,128"; do
  q=${sh%%:*}; c=${sh#*:}; I="torch.randn($q), torch.randn($c), torch.randn($c)"; tag=$(echo "$q" | tr , x)
  for v in "A:$P($I)" "B:$P($I).contiguous()" "C:$P($I).transpose(1,2).contiguous()" "Aold:$P($I)" \
           "Cold:$P($I).transpose(1,2).contiguous()"; do
    n=${v%%:*}; e=${v#*:}; src=$PWD/src; case $n in *old) src=$old;; esac
    PYTHONPATH=$src:${PYTHONPATH:-} timeout 100 python3 -m tilefuse.cli run --dtype bf16 --bench --seed 1 -c "$e" \
      > "$out/rope_${tag}_$n.txt" 2>&1
    echo "$tag $n: $(grep -E '^│ (tilefuse|torch.compile)' "$out/rope_${tag}_$n.txt" | tr -s ' ' | tr '\n' ' ')"
  done
done
