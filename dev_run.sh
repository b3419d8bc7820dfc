python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src
timeout 240 python3 -m pytest -m gpu -q -n 8 -p no:logging tests/gpu/test_programs_gemm_gpu.py tests/gpu/test_hf_architectures_gpu.py tests/gpu/test_shared_kernels_gpu.py tests/gpu/test_gemm_m_arg_gpu.py tests/gpu/test_static_cache_gpu.py 2>&1 | tail -3
G="python3 bench/generate.py --modes tilefuse --layers 8 --hidden 4096 --prompt 3000 --new 16 --repeats 1 --stage-times --mask-skip"
timeout 170 $G --json $OUT/gen_first_after.json 2>&1 | tail -3
PYTHONPATH=/tmp/site:$PWD/.old/head/src TILEFUSE_SRC=$PWD/.old/head/src timeout 170 $G --json $OUT/gen_first_before.json 2>&1 | tail -3
for f in after before; do python3 -c "
import json;r=json.load(open('$OUT/gen_first_$f.json'))['rows'][0]
st=r['stage_times']
print('$f', 'first_s %.2f'%r['first_s'], 'other %.2f'%r['other_prompt_s'], [(g.get('nvrtc (summed over threads)',{}).get('n'), round(g.get('nvrtc (summed over threads)',{}).get('s',0),1), round(g.get('variant compile (wall)',{}).get('s',0),1)) for g in st], r['tokens'][:4])"; done
