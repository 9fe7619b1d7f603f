#!/usr/bin/env bash
# H200 run for the refit core: CUDA IPC tests, then `mxrefit bench` on the tiny default and on
# qwen3-30b-a3b (exact shapes), JSON + plots into $OUT. Needs pyzmq carried as a wheel in .whl/.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -m pytest -q -p no:cacheprovider tests/test_buffers.py -k cuda 2>&1 | tail -5
python3 -m mxrefit bench --device cuda --steps 5 --no-progress --json $OUT/bench_tiny_cuda.json
python3 -m mxrefit bench --model qwen3-30b-a3b --device cuda --steps ${STEPS:-3} --bucket-mb ${BUCKET_MB:-512} --no-progress --json $OUT/bench_30b.json --plot $OUT/bench_30b.png
