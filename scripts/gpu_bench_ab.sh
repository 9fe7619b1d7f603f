#!/usr/bin/env bash
# `mxrefit bench` on the GPU, this tree against a baseline tree, in one device call (no vLLM needed).
# Once, here: a baseline package and pyzmq (the device image lacks it) in ignored folders:
#   echo /.old/ >> .git/info/exclude; echo /.whl2/ >> .git/info/exclude
#   mkdir -p .old .whl2 && git archive REV mxrefit | tar -x -C .old
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl2 pyzmq
# Then one device call, carry [".old", ".whl2"]:  bash scripts/gpu_bench_ab.sh [ROUNDS] -- BENCH ARGS...
# BASE=.old2 takes the baseline package from another ignored folder (carry that one instead).
# Runs baseline, this tree, baseline, this tree ... (ROUNDS pairs, default 1): each run measures its own copy floor.
# TRACE=1 adds `--trace` to this tree's runs (one profiled refit per mode, traces in $OUT/traces_TAG_ROUND).
# TAG names the files (bench_TAG_TREE_ROUND.*), so several models can run in one call:
#   TAG=30b bash scripts/gpu_bench_ab.sh 2 -- --model qwen3-30b-a3b --mode checks --steps 5; TAG=32b bash scripts/gpu_bench_ab.sh -- --model qwen3-32b ...
set -uo pipefail
rounds=1
if [[ ${1:-} != -- && -n ${1:-} ]]; then rounds=$1; shift; fi
[[ ${1:-} == -- ]] && shift
python3 -m pip install -q --no-index --no-deps --target /tmp/zmq .whl2/*.whl || exit 3
export PYTHONPATH=/tmp/zmq PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
# an 80 GB card holds 24 layers of the large models beside their engine, not all of them (on an H100
# on 2026-12-06 the 48-layer 30B, 32B and 235B share ran out of memory): cap the layers unless asked
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if (( mib < 100000 )) && [[ " $* " != *" --layers "* ]]; then set -- "$@" --layers 24; echo "80 GB card: --layers 24"; fi
root=$PWD
for r in $(seq 1 $rounds); do
  for tree in baseline this; do
    dir=$root; [[ $tree == baseline ]] && dir=$root/${BASE:-.old}
    f=$OUT/bench_${TAG:-ab}_${tree}_$r
    extra=()  # TRACE=1: this tree also profiles one refit per mode (bench --trace; the baseline may predate it)
    [[ -n ${TRACE:-} && $tree == this ]] && extra=(--trace $OUT/traces_${TAG:-ab}_$r)
    (cd $dir && timeout ${BENCH_TIMEOUT:-300} python3 -m mxrefit bench --device cuda --no-progress --json $f.json "$@" ${extra[@]+"${extra[@]}"}) > $f.log 2>&1
    echo "== ${TAG:-ab} $tree, round $r (rc $?)"; grep -E "total, ms|quantize/pack|finite check|x copy floor|rate, GB/s|identical|traced refit|Error" $f.log
  done
done
