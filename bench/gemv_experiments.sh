#!/usr/bin/env bash
# The GEMV's experiments in one device call (about 7 minutes at one pair; run in session 54,
# bench/results/s54/, which made groups and the few-CTA prefetch the defaults): the GEMV GPU
# tests, the tensor-core form's L2 prefetch knob against the same layout without it, Q/K/V as
# one launch against three (bench/gemv.py --groups), then decode steps with TILEFUSE_GEMV_GROUPS
# 0 and 1 alternated, one process each ($PAIRS pairs, default 1: ~40 s a process). JSON and
# logs under $OUT (or ./gemv_experiments), a short table from each step on stdout; each step
# under its own time limit.
#
#     bash bench/gemv_experiments.sh            # on the GPU machine, from the repository root
set -u
out=${OUT:-gemv_experiments}
mkdir -p "$out"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  [ $? -eq 124 ] && echo "$name: timed out after ${limit} s"
  tail -n 14 "$out/$name.log"
}
step gemv_tests 120 python3 -m pytest -m gpu -q -n 8 -p no:logging tests/gpu/test_gemv_gpu.py
step prefetch 90 python3 bench/gemv.py --m 1,4 --sweep prefetch --json "$out/gemv_prefetch.json"
step groups 60 python3 bench/gemv.py --m 1,4 --groups --json "$out/gemv_groups.json"
for i in $(seq 1 "${PAIRS:-1}"); do
  for g in 0 1; do
    for c in decode8 decode8b4; do
      TILEFUSE_GEMV_GROUPS=$g timeout 70 python3 bench/blocks.py --cases $c --rounds 1 \
        --json "$out/${c}_groups$g.$i.json" > "$out/${c}_groups$g.$i.log" 2>&1
      echo "$c groups=$g run $i: $(grep -o '"tilefuse_ms": [0-9.]*' "$out/${c}_groups$g.$i.json")"
    done
  done
done
