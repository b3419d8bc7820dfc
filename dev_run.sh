rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 bench/compile_time.py --cases llama4,hf_llama,gpt2 --json $OUT/compile_time_s45_h200.json 2>&1 | tail -6
# the tree before the GEMM-sharing fix: bench/blocks.py imports src from the repo, so swap src in place
mv src src.new && cp -r .old/pre/src src
timeout 120 python3 bench/compile_time.py --cases llama4,hf_llama --json $OUT/compile_time_pre_s45_h200.json 2>&1 | tail -5
rm -rf src && mv src.new src
FUZZ_SECONDS=90 timeout 120 python3 fuzz/gemm.py 9100000 100000 $OUT/gemm_fuzz 2>&1 | tail -5
