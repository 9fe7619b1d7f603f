#!/usr/bin/env bash
# H200 run for the refit path, through the device tool with .whl/ (pyzmq) carried.
#   PART=tests|profile|30b|more|fp8, or several joined by commas (default: all, which needs more than one
#   10-minute call)
# profile: scripts/gpu_pack_profile.py (kernel launch shapes of the packing, the finite screen, TRT-LLM layouts)
# tests: CUDA-only tests (IPC buffers, direct writes, finite-check kernel) + the tiny model bench
# 30b:   qwen3-30b-a3b exact shapes, baseline vs prequant (direct) vs prequant-buffers, TRT-LLM post-process
# more:  qwen3-32b and qwen3-235b-a22b-ep8 (baseline vs prequant), and a layer sweep of qwen3-30b-a3b
# fp8:   qwen3-30b-a3b in 128x128 block FP8 (vLLM Fp8Config layout, no post-process), all modes, and
#        MXFP8 with --post none in the same call, so the two formats compare without post-processing
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
PART=${PART:-all}
has() { [[ $PART == all || ",$PART," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
bench() { python3 -m mxrefit bench --device cuda --no-progress "$@"; }
if has tests; then
  python3 -m pytest -q -p no:cacheprovider tests/integration/test_buffers.py tests/integration/test_direct.py tests/unit/test_finite_check.py -k cuda 2>&1 | tail -5
  bench --steps 5 --mode all --json $OUT/bench_tiny_cuda.json
fi
if has profile; then
  python3 scripts/gpu_pack_profile.py --json $OUT/pack_profile.json | tail -80
fi
if has 30b; then
  bench --model qwen3-30b-a3b --steps ${STEPS:-3} --bucket-mb ${BUCKET_MB:-512} --mode all --json $OUT/bench_30b.json --plot $OUT/bench_30b.png
fi
if has fp8; then
  bench --model qwen3-30b-a3b --format fp8-block --steps ${STEPS:-3} --bucket-mb ${BUCKET_MB:-512} --mode all \
    --json $OUT/bench_30b_fp8_block.json --plot $OUT/bench_30b_fp8_block.png
  bench --model qwen3-30b-a3b --format mxfp8 --post none --steps ${STEPS:-3} --bucket-mb ${BUCKET_MB:-512} --mode prequant \
    --json $OUT/bench_30b_mxfp8_nopost.json
fi
if has more; then
  bench --model qwen3-32b --steps 3 --json $OUT/bench_32b.json --plot $OUT/bench_32b.png
  bench --model qwen3-235b-a22b-ep8 --steps 3 --json $OUT/bench_235b_ep8.json --plot $OUT/bench_235b_ep8.png
  for L in 6 12 24; do
    bench --model qwen3-30b-a3b --layers $L --steps 3 --mode prequant --json $OUT/sweep_30b_${L}l.json
  done
fi
