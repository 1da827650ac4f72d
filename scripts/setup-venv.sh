#!/usr/bin/env bash
# Creates .venv (if missing) and installs tq-redis with the extras EXTRAS names into it (default
# "test", the whole test set; scripts/demo asks for "demo": rich and matplotlib, about 2 minutes here).
# torch is installed first and pinned, so pip never pulls a multi-GB CUDA build by accident;
# set TORCH_SPEC to choose another build (e.g. TORCH_SPEC="torch==2.13.0+cu126").
# VENV=DIR builds another environment (default .venv); CONSTRAINTS=FILE applies a pip constraints
# file to every install (CI builds .venv-oldest with .ci/oldest-constraints.txt: the lowest versions
# of tensordict, torch, numpy and Ray that pyproject.toml allows).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-test}
pip_args=(-q)
if [ -n "${CONSTRAINTS:-}" ]; then
  pip_args+=(-c "$CONSTRAINTS")
fi
# a venv whose creation was interrupted has a python but no pip: make it again
if [ ! -x "$VENV/bin/python" ] || [ ! -x "$VENV/bin/pip" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv --clear "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing ${TORCH_SPEC:-torch==2.13.0}"
  "$VENV/bin/pip" install "${pip_args[@]}" "${TORCH_SPEC:-torch==2.13.0}"
fi
# tq_redis.codec._copy (the data plane's batched copies) and tq_redis.codec._scan (a batch's sizes and key
# hashes) are compiled at install: they need a C compiler and Python's headers. Without them the
# install still works, with the same work done, more slowly, in Python.
headers=$("$VENV/bin/python" -c "import os, sysconfig; print(os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))")
build_deps=()
command -v cc >/dev/null 2>&1 || build_deps+=(gcc libc6-dev)
[ "$headers" = True ] || build_deps+=(python3-dev)
if [ ${#build_deps[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing build tools for the native modules: ${build_deps[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${build_deps[@]}" >/dev/null
  else
    echo "[setup] note: ${build_deps[*]} missing; tq_redis.codec._copy and tq_redis.codec._scan will not build and their work runs in Python"
  fi
fi
# One stamp per extras set: the install is redone when the project's build files are newer than it
fresh() {
  [ -f "$1" ] && [ ! pyproject.toml -nt "$1" ] && [ ! setup.py -nt "$1" ] \
    && { [ -z "${CONSTRAINTS:-}" ] || [ ! "$CONSTRAINTS" -nt "$1" ]; } \
    && [ -z "$(find tq_redis -name '*.c' -newer "$1")" ]
}
stamp=$VENV/.tq-installed-$EXTRAS
# the test set holds the demo's: a venv made for the tests serves the demo as it is
if fresh "$stamp" || { [ "$EXTRAS" = demo ] && fresh "$VENV/.tq-installed-test"; }; then
  exit 0
fi
echo "[setup] installing tq-redis (editable) with the [$EXTRAS] extras into $VENV"
# editable_mode=compat puts the checkout itself on sys.path (a .pth file holding its path) instead of
# an import hook: mypy, pyright and IDEs follow a static path, not setuptools' finder
"$VENV/bin/pip" install "${pip_args[@]}" -e ".[$EXTRAS]" --config-settings editable_mode=compat
touch "$stamp"
