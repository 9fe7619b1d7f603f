#!/usr/bin/env bash
# A real vLLM 0.26.0 on the H200 (issue 22), carried in parts as ../shared/vllm-h200/README.md says.
# Once, here, in the repo root:
#   echo /.vwhl/ >> .git/info/exclude; mkdir -p .vwhl; cp -r /work/shared/vllm-h200/p? .vwhl/
# Then three device calls back to back (a machine idle for ~30 s is given back, with what it holds):
#   1. carry [".vwhl/p1"]:            bash scripts/gpu_vllm.sh p1
#   2. carry [".vwhl/p3"]:            bash scripts/gpu_vllm.sh p3          (MoE kernels)
#   3. carry [".vwhl/p2",".vwhl/p4"]: bash scripts/gpu_vllm.sh install oracle,moehang
# and later calls on the same machine: bash scripts/gpu_vllm.sh run PARTS (install is skipped when done).
# PARTS, comma-separated (run concurrently, each in its own process tree):
#   oracle   dense Qwen3 BF16 + MXFP8 (worker extension), MXFP8 (weight-transfer backend), Qwen3-MoE BF16:
#            three refits after AdamW steps, each checked against a fresh vLLM from a checkpoint (vllm_oracle.py)
#   mx       dense Qwen3 MXFP8 (worker extension) alone: the Marlin workspace check
#   fp8      dense Qwen3 FP8-block (Fp8Config) through the worker extension, same check
#   moehang  the Qwen3-MoE MXFP8 start, stacks of every process at a deadline (vllm_moe_hang.py), and the
#            MoE MXFP8 oracle run with moe_backend=triton
#   marlin   every Marlin MXFP8 engine (dense, MoE; extension and weight-transfer backend) + MoE BF16 through the backend
#   learned  dense and MoE MXFP8 on Marlin with MXREFIT_LEARNED_LAYOUT=1 (learned byte gather), and MoE BF16 (the experts'
#            identity, learn_identity), each against a fresh vLLM;
#            the headline with it: MXREFIT_LEARNED_LAYOUT=1 HEADLINE_FMTS=mxfp8 bash scripts/gpu_vllm.sh run headline
#   sleep    dense BF16 and MoE MXFP8 with enable_sleep_mode: sleep(level=1) / wake_up before every refit
#   soak     MoE MXFP8, SOAK_REFITS (100) refits with generation between; worker resources sampled; oracle at the end
#   headline Qwen3-30B-A3B shapes, dummy weights: mxrefit vs vLLM's own IPC path (vllm_headline.py)
#   trl      TRL 1.16 GRPOTrainer colocate, ~1.7B random Qwen3: TRL's own weight sync vs mxrefit's, per-step sync and
#            step times (gpu_trl.py; TRL_FMTS=bf16,mxfp8 adds MXFP8); TRL + datasets wheels from .whl/ into /tmp/site4
#   gather   the learned byte gather alone (gpu_gather_profile.py, run it alone: it times): vLLM's Marlin MXFP8 layouts
#            of Qwen3-30B-A3B learned as the engine does, the library gather and kernel variants against a copy
#   digests  the 3.54e-4 hunt (docs/vllm.md): dense MXFP8 through the extension, the backend and the learned layout,
#            sha256 of every parameter, buffer and plain kernel tensor of engine A and of each fresh vLLM compared
#   peervllm `mxrefit bench --peer vllm` (run it alone: it times): qwen3-30b-a3b at PEER_LAYERS (24) layers, MXFP8
#            then BF16 (PEER_FMTS), mxrefit (learned layout on, CUDA's default) and vLLM's own IPC path into one
#            real vLLM, and the byte check; FMT+processing runs with MXREFIT_LEARNED_LAYOUT=0 (vLLM's Marlin
#            processing every refit)
#   bench    issue 23 on the GPU (run it alone: it times): scripts/gpu_bench_table.sh, every part, beside this vLLM's
#            packages (checkpoint-engine's wheel from .whl/); that script alone needs no vLLM
# Everything lands in /tmp/res, packed at the end into $OUT/vllm_h200_<parts>.tar.gz, plus $OUT/summary.txt.
set -uo pipefail
step=${1:?p1|p3|install|run}
PARTS=${2:-}
case $step in
  p1|p3) mkdir -p /root/vwhl && cp -f .vwhl/$step/* /root/vwhl/ && ls -la /root/vwhl; exit ;;
  install|run) ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
if [[ ! -d /tmp/site/vllm ]]; then
  [[ $step == install ]] || { echo "vLLM is not installed on this machine: start again with p1"; exit 3; }
  mkdir -p /root/vwhl && cp -f .vwhl/p2/* /root/vwhl/ && python3 /root/vwhl/vinstall.py /root/vwhl /tmp/site || exit 3
  python3 -m pip install -q --no-index --no-deps --target /tmp/site2 .vwhl/p4/*.whl || exit 3
fi
# mxrefit is on PYTHONPATH, not pip-installed, so its vllm.general_plugins entry point (pyproject.toml)
# is not registered: a minimal .dist-info on the path declares it, so vLLM's own processes load the
# "mxrefit" weight-transfer backend as they would from an installed mxrefit.
mkdir -p /tmp/site3/mxrefit_plugin-0.0.dist-info
printf 'Metadata-Version: 2.1\nName: mxrefit-plugin\nVersion: 0.0\n' > /tmp/site3/mxrefit_plugin-0.0.dist-info/METADATA
printf '[vllm.general_plugins]\nmxrefit = mxrefit.integrations.vllm.plugin:register\n' > /tmp/site3/mxrefit_plugin-0.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:/tmp/site2:/tmp/site3:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 PYTHONUNBUFFERED=1 \
  TORCHINDUCTOR_COMPILE_THREADS=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
[[ -n $PARTS ]] || exit 0
RES=/tmp/res; mkdir -p $RES
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee $RES/gpu.txt
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" 2>&1 | tail -1 | tee -a $RES/gpu.txt
has() { [[ ",$PARTS," == *",$1,"* ]]; }
wheels() {  # the wheels in .whl/ (TRL and its datasets, checkpoint-engine), into /tmp/site4 once per machine
  if [[ ! -f /tmp/site4/.done ]] && compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site4 .whl/*.whl && touch /tmp/site4/.done
  fi
  export PYTHONPATH=$PYTHONPATH:/tmp/site4
}
pids=()
oracle() {  # oracle TAG ARGS...: one vllm_oracle.py run in the background
  local tag=$1; shift
  timeout ${ORACLE_TIMEOUT:-480} python3 scripts/vllm_oracle.py run --json $RES/oracle_$tag.json --work /tmp/oracle/$tag "$@" \
    > $RES/oracle_$tag.log 2>&1 &
  pids+=($!)
}
if has oracle; then
  oracle dense_bf16_ext --model dense --fmt bf16 --via ext
  oracle dense_mxfp8_ext --model dense --fmt mxfp8 --via ext
  oracle dense_mxfp8_wt --model dense --fmt mxfp8 --via wt
  oracle moe_bf16_ext --model moe --fmt bf16 --via ext
fi
has mx && oracle dense_mxfp8_ext --model dense --fmt mxfp8 --via ext
if has marlin; then  # every Marlin engine (dense and MoE MXFP8) and the MoE weight-transfer runs, after the workspace fix
  oracle dense_mxfp8_ext --model dense --fmt mxfp8 --via ext
  oracle dense_mxfp8_wt --model dense --fmt mxfp8 --via wt
  oracle moe_mxfp8_ext --model moe --fmt mxfp8 --via ext --max-batched-tokens 512
  oracle moe_mxfp8_wt --model moe --fmt mxfp8 --via wt --max-batched-tokens 512
  oracle moe_bf16_wt --model moe --fmt bf16 --via wt
fi
if has learned; then  # the Marlin MXFP8 engines with MXREFIT_LEARNED_LAYOUT=1 (a byte gather learned from vLLM's processing)
  VLLM_ALLOW_INSECURE_SERIALIZATION=1 MXREFIT_LEARNED_LAYOUT=1 oracle dense_mxfp8_learned --model dense --fmt mxfp8 --via ext
  VLLM_ALLOW_INSECURE_SERIALIZATION=1 MXREFIT_LEARNED_LAYOUT=1 oracle moe_mxfp8_learned --model moe --fmt mxfp8 --via ext --max-batched-tokens 512
  VLLM_ALLOW_INSECURE_SERIALIZATION=1 MXREFIT_LEARNED_LAYOUT=1 oracle moe_mxfp8_learned_wt --model moe --fmt mxfp8 --via wt --max-batched-tokens 512
  # the BF16 experts' identity (learn_identity): its learned_layouts entry must say "identity" and the oracle pass
  VLLM_ALLOW_INSECURE_SERIALIZATION=1 MXREFIT_LEARNED_LAYOUT=1 oracle moe_bf16_learned --model moe --fmt bf16 --via ext --max-batched-tokens 512
fi
if has sleep; then  # vLLM's sleep mode: sleep(level=1) / wake_up before every refit (SLEEP_MODELS=moe: the MoE run only)
  [[ ${SLEEP_MODELS:-dense,moe} == *dense* ]] && oracle dense_bf16_sleep --model dense --fmt bf16 --via ext --sleep
  [[ ${SLEEP_MODELS:-dense,moe} == *moe* ]] && oracle moe_mxfp8_sleep --model moe --fmt mxfp8 --via ext --sleep --max-batched-tokens 512
fi
if has soak; then  # 100 refits of a small MXFP8 MoE with generation between, resources sampled, oracle at the end
  VLLM_ALLOW_INSECURE_SERIALIZATION=1 oracle moe_mxfp8_soak --model moe --fmt mxfp8 --via ext --max-batched-tokens 512 \
    --refits ${SOAK_REFITS:-100} --train-steps 1 --oracle-last --stats-every 10
fi
if has digests; then
  export VLLM_ALLOW_INSECURE_SERIALIZATION=1
  oracle dense_mxfp8_ext_kd --model dense --fmt mxfp8 --via ext --kernel-digests --reload-check
  oracle dense_mxfp8_wt_kd --model dense --fmt mxfp8 --via wt --kernel-digests --reload-check
  VLLM_ALLOW_INSECURE_SERIALIZATION=1 MXREFIT_LEARNED_LAYOUT=1 oracle dense_mxfp8_learned_kd --model dense --fmt mxfp8 --via ext --kernel-digests --reload-check
fi
has fp8 && oracle dense_fp8block_ext --model dense --fmt fp8-block --via ext
if has moehang; then
  # periodic dumps (HANG_DUMP_S > 0) crashed vLLM processes at start-up (SIGSEGV in the timer's dump, 2026-12-04):
  # the default is SIGUSR1 at the deadline only
  MXREFIT_FAULTHANDLER_S=${HANG_DUMP_S:-0} timeout 400 python3 scripts/vllm_moe_hang.py --timeout ${HANG_S:-170} \
    --variants ${HANG_VARIANTS:-auto-profile,auto-eager-tokens-scale,triton-eager-tokens-scale,bf16-eager-tokens-scale} \
    --log $RES/moe_hang.log --json $RES/moe_hang.json > $RES/moe_hang.out 2>&1 &
  pids+=($!)
  oracle moe_mxfp8_ext --model moe --fmt mxfp8 --via ext --max-batched-tokens 512
  oracle moe_mxfp8_triton_ext --model moe --fmt mxfp8 --via ext --moe-backend triton
fi
if has headline; then
  # vLLM's own IPC path: its update_info carries torch's rebuild_cuda_tensor arguments (a torch dtype among them),
  # which vLLM's msgspec RPC refuses unless the pickle fallback is allowed (mxrefit's own channel never pickles).
  # HEADLINE_PROFILE=1: vLLM's processing timed per module kind; it syncs the device around every module, so timed
  # runs leave it off (the H200's BF16 refit timed with it on 2026-12-05: 242 ms; without it on 2026-12-04: 144 ms)
  # HEADLINE_TAG names the files (headline_TAG.json), so one call runs the headline twice with other arguments
  tag=${HEADLINE_TAG:+_$HEADLINE_TAG}
  MXREFIT_PROFILE=${HEADLINE_PROFILE:-0} VLLM_ALLOW_INSECURE_SERIALIZATION=1 PYTHONPATH=$PYTHONPATH:$PWD/scripts/vllm_hooks/noray timeout ${HEADLINE_TIMEOUT:-500} python3 scripts/vllm_headline.py \
    --fmts ${HEADLINE_FMTS:-mxfp8,bf16} ${HEADLINE_ARGS:-} --json $RES/headline$tag.json > $RES/headline$tag.log 2>&1 &
  pids+=($!)
fi
if has gather; then  # the learned byte gather alone on vLLM's Marlin layouts of Qwen3-30B-A3B: kernel variants against a copy
  timeout ${GATHER_TIMEOUT:-300} python3 scripts/gpu_gather_profile.py --json $RES/gather.json > $RES/gather.log 2>&1 &
  pids+=($!)
fi
if has trl; then  # TRL and its wheels (.whl/: trl, datasets, dill, multiprocess)
  wheels
  timeout ${TRL_TIMEOUT:-420} python3 scripts/gpu_trl.py --mode both --fmt ${TRL_FMTS:-bf16} \
    --json $RES/trl.json > $RES/trl.log 2>&1 &
  pids+=($!)
fi
if has peervllm; then  # in the foreground, one format after another: it times
  fmts=${PEER_FMTS:-mxfp8,bf16}
  for f in ${fmts//,/ }; do
    learned=; [[ $f == *+processing ]] && learned=0
    tag=${f/+/_}
    MXREFIT_LEARNED_LAYOUT=$learned PYTHONPATH=$PYTHONPATH:$PWD/scripts/vllm_hooks/noray timeout ${PEER_TIMEOUT:-280} \
      python3 -m mxrefit bench --device cuda --no-progress --model qwen3-30b-a3b --layers ${PEER_LAYERS:-24} \
      --format ${f%+processing} --mode prequant --peer vllm --steps 3 --json $RES/peer_vllm_$tag.json > $RES/peer_vllm_$tag.log 2>&1
    echo "== peer_vllm_$tag (rc $?)" >> $RES/peer_vllm.txt
    sed -n '/mxrefit bench:/,$p' $RES/peer_vllm_$tag.log | grep -Ev '^(\(EngineCore|\[W|INFO|WARNING)' | tail -40 >> $RES/peer_vllm.txt
  done
fi
if has bench; then
  wheels
  RES=$RES bash scripts/gpu_bench_table.sh > $RES/bench_table.log 2>&1 &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait $p; done
{
  for f in $RES/oracle_*.log $RES/moe_hang.out $RES/headline*.log $RES/gather.log $RES/trl.log $RES/pytest_*.log $RES/bench_*.log; do
    [[ -f $f ]] || continue
    echo "== $(basename $f)"; grep -E "oracle:|moe_hang:|headline:|gather|GB/s|trl_bench:|VARIANT-|Error|error:|passed|failed|total, ms|x copy floor|intercept|checkpoint-engine" $f | grep -v "^\s*$" | tail -14
  done
  [[ -f $RES/peer_vllm.txt ]] && cat $RES/peer_vllm.txt
} > $RES/summary.txt 2>&1
cp $RES/summary.txt $OUT/summary.txt
tar -czf $OUT/vllm_h200_${PARTS//,/_}.tar.gz -C $RES . 2>/dev/null
cat $OUT/summary.txt
