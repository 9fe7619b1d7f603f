#!/usr/bin/env bash
# H200 run for reliability and the colocated phase, through the device tool with .whl/ (pyzmq) carried:
#   1. scripts/gpu_soak.py: 100 qwen3-30b-a3b refits direct and through buffers, 30 + 30 under
#      expandable_segments, resources sampled (issue 8)
#   2. mxrefit bench --mode checks --post none: what --verify and transactional engines cost (issue 8), and the
#      fused non-finite screen (prequant-fused: check_finite=False, one read of the weights; issue 23)
#   3. scripts/gpu_lifecycle.py --phase-only: prepare-for-generation around qwen3-30b-a3b refits (issue 7), 12 GiB
#      of optimizer state (20 GiB + the 30B weights, the engine with its TRT-LLM copies and a 20 GiB KV stand-in
#      would need ~138 of the H200's 140 GiB; offload bandwidth at 20 GiB is recorded by the full script)
# Each part has its own time limit (SOAK_S, CHECKS_S, PHASE_S) so one slow part cannot starve the others;
# SOAK_RUNS picks soak runs (e.g. direct,direct_expandable) when device time is short; PARTS=soak,checks,phase picks parts.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
PARTS=${PARTS:-soak,checks,phase}
has() { [[ ",$PARTS," == *",$1,"* ]]; }
if has soak; then
timeout ${SOAK_S:-260} python3 scripts/gpu_soak.py ${SOAK_RUNS:+--runs $SOAK_RUNS} > "$OUT/soak_stdout.txt" 2>&1; echo "soak rc=$?"
tail -8 "$OUT/soak_stdout.txt"
fi
if has checks; then
timeout ${CHECKS_S:-140} python3 -m mxrefit bench --device cuda --no-progress --model qwen3-30b-a3b --post none --mode checks \
  --steps 3 --json "$OUT/bench_30b_checks.json" > "$OUT/checks_stdout.txt" 2>&1; echo "checks rc=$?"
grep -v "^│\|^┃\|^┏\|^┡\|^└" "$OUT/checks_stdout.txt" | tail -6
fi
if has phase; then
timeout ${PHASE_S:-120} python3 scripts/gpu_lifecycle.py --phase-only --phase-steps 2 --state-gib 12 --json "$OUT/lifecycle_phase.json" \
  > "$OUT/phase_stdout.txt" 2>&1; echo "phase rc=$?"
tail -4 "$OUT/phase_stdout.txt"
fi
