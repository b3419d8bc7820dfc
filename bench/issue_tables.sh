#!/usr/bin/env bash
# The three open issues' tables in one device call (about 9.5 minutes at most), each step under
# its own time limit so that what finishes is kept: issue 5's blocks, issue 4's GEMM tables
# (plain and fused), issue 2's map-reduce table. JSON under $OUT (or ./issue_tables), a short
# table from each script on stdout. A step cut short says so ("timed out"), and its limit or
# --rounds wants adjusting. On an H200 with an empty cubin cache (session 46) the four steps
# took 265 s together, each well inside its limit.
#
#     bash bench/issue_tables.sh            # on the GPU machine, from the repository root
set -u
out=${OUT:-issue_tables}
mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '_')
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "$name: timed out after ${limit} s"
  tail -n 16 "$out/$name.log"
}
step blocks 200 python3 bench/blocks.py --cases mlp,layer7b,llama4 --rounds 3 --json "$out/blocks_$gpu.json"
step gemm 110 python3 bench/gemm.py --json "$out/gemm_$gpu.json"
step gemm_fused 110 python3 bench/gemm.py --fused --json "$out/gemm_fused_$gpu.json"
step mapreduce 130 python3 bench/mapreduce.py --rounds 3 --json "$out/mapreduce_$gpu.json"
