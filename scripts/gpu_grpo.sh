#!/usr/bin/env bash
# H200 run of examples/grpo_loop.py with the PyTorch engine (no vLLM there): an engine process
# holds the rollout model behind TorchEngine + Receiver on the same GPU as the trainer, refits
# go straight into its memory over CUDA IPC, MXFP8 (E4M3 + scales, dequantized into the BF16
# model that HF generate runs) and BF16 for comparison, 20 steps each, about 2 minutes in all.
# Through the device tool with .whl/ (pyzmq) carried, as scripts/gpu_refit.sh:
#   bash scripts/gpu_grpo.sh            -> $OUT/grpo_torch_mxfp8_cuda.json, $OUT/grpo_torch_bf16_cuda.json, $OUT/grpo.log
# On CPU (smoke): DEVICE=cpu STEPS=2 OUT=/tmp/grpo bash scripts/gpu_grpo.sh
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-20}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
[[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
rc=0
for FMT in mxfp8 bf16; do
  $PY examples/grpo_loop.py --engine torch --format $FMT --device $DEVICE --steps $STEPS \
    --json "$OUT/grpo_torch_${FMT}_${DEVICE}.json" 2>&1 | tee -a "$OUT/grpo.log" || rc=1
done
exit $rc
