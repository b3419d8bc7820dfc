rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src
timeout 85 python3 -m pytest -m gpu -q -n 8 -p no:logging tests/gpu/test_programs_gemm_gpu.py 2>&1 | tail -4
