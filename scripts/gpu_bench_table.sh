#!/usr/bin/env bash
# Issue 23's bench table on the GPU, one command after another (it times: run it alone), no vLLM needed.
# Device call, carry [".whl", ".whl2", ".whl3"] (checkpoint-engine, pyzmq, and checkpoint-engine's
# dependencies the device image lacks; gpu_vllm.sh's `bench` part runs this same list beside a vLLM):
#   bash scripts/gpu_bench_table.sh [PARTS]       PARTS, comma-separated, default all of:
#   pack     gpu_pack_profile.py: the kernels alone against a copy of the same bytes
#   opens    the same-process CUDA opens (pytest)
#   peer     qwen3-30b-a3b 24 layers BF16 beside checkpoint-engine's own code path
#   mxfp8    the MXFP8 + TRT-LLM default, fused screen, verify, transactional (--mode checks)
#   fused    the BF16 engine's fused screen (peer has its default; --mode checks would hold a 31 GB shadow too)
#   layouts  the two-pass TRT-LLM layout and every TRT-LLM layout from the trainer, for comparison
#   sweep    the layer sweep with its fit (time linear in bytes, intercept)
#   others   qwen3-32b and the qwen3-235b-a22b EP8 share (issue 23: nothing slower than before)
# The carried folders, made here (ignored by git; python 3.12 wheels for the device image, which holds
# anyio, click, h11, idna, typing-extensions and annotated-doc already):
#   P="--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64"
#   pip download --no-deps -d .whl checkpoint-engine==0.4.2; pip download --no-deps $P -d .whl2 pyzmq
#   pip download --no-deps $P -d .whl3 fastapi starlette pydantic pydantic-core annotated-types \
#     typing-inspection opentelemetry-api uvicorn loguru
# Files land in $RES (bench_TAG.{json,log}, pack_profile.{json,log}; summary lines on stdout); without
# RES, in /tmp/bench_table, packed at the end into $OUT/bench_table.tar.gz (a call brings back few files).
set -uo pipefail
PARTS=${1:-pack,opens,peer,mxfp8,fused,layouts,sweep,others}
pack_into_out=; [[ -z ${RES:-} ]] && pack_into_out=1
RES=${RES:-/tmp/bench_table}; mkdir -p $RES
if ! python3 -c "import zmq, checkpoint_engine" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/benchsite .whl2/*.whl .whl3/*.whl .whl/checkpoint_engine-*.whl || exit 3
  export PYTHONPATH=/tmp/benchsite:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $RES/gpu_bench.txt
has() { [[ ",$PARTS," == *",$1,"* ]]; }
b() {
  local tag=$1; shift
  timeout ${BENCH_TIMEOUT:-200} python3 -m mxrefit bench --device cuda --no-progress --model qwen3-30b-a3b \
    --json $RES/bench_$tag.json "$@" > $RES/bench_$tag.log 2>&1
  echo "== bench_$tag (rc $?)"; grep -E "total, ms|x copy floor|rate, GB/s|checkpoint-engine|intercept|identical|Error|^│" $RES/bench_$tag.log | tail -30
}
# all 48 layers need the H200's memory (61 GB of BF16 beside the engine); an 80 GB H100 runs 24 and sweeps to 24
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if (( mib > 100000 )); then full=48 sweep=6,12,24,48; else full=24 sweep=6,12,18,24; fi
if has pack; then
  timeout 200 python3 scripts/gpu_pack_profile.py --json $RES/pack_profile.json > $RES/pack_profile.log 2>&1
  echo "== pack_profile (rc $?)"; tail -5 $RES/pack_profile.log
fi
if has opens; then
  python3 -m pytest -q -p no:cacheprovider tests/integration/test_buffers.py tests/unit/test_bucket_flags.py -k "owner or exporting or marked" > $RES/pytest_same_process.log 2>&1
  echo "== pytest_same_process"; tail -2 $RES/pytest_same_process.log
fi
has peer && b peer_bf16 --layers 24 --format bf16 --mode prequant --peer checkpoint-engine --steps 5
has mxfp8 && b mxfp8 --layers $full --mode checks --steps 5
has fused && b bf16_fused --layers 24 --format bf16 --mode prequant-fused --steps 5
if has layouts; then
  b mxfp8_staged --layers $full --mode prequant --post trtllm-staged --steps 5
  b mxfp8_grouped --layers $full --mode prequant --experts grouped --steps 5
fi
has sweep && b sweep --mode prequant --sweep-layers $sweep --steps 3 --plot $RES/sweep_30b.png
if has others; then  # b's --model comes first; a later one wins
  b qwen3_32b --model qwen3-32b --mode prequant --steps 5
  b qwen3_235b_ep8 --model qwen3-235b-a22b-ep8 --mode prequant --steps 5
fi
[[ -n $pack_into_out ]] && tar -czf ${OUT:-/tmp}/bench_table.tar.gz -C $RES .
exit 0
