#!/usr/bin/env bash
# Creates .venv (if missing) and installs tq-redis with its test extras into it.
# torch is installed first and pinned, so pip never pulls a multi-GB CUDA build by accident;
# set TORCH_SPEC to choose another build (e.g. TORCH_SPEC="torch==2.13.0+cu126").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing ${TORCH_SPEC:-torch==2.13.0}"
  .venv/bin/pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
stamp=.venv/.tq-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing tq-redis (editable) with test extras"
  .venv/bin/pip install -q -e ".[test]"
  touch "$stamp"
fi
