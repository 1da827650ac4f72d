#!/usr/bin/env bash
# Create (or update) the benchmark virtual environment `.venv-bench` in the repository root,
# holding BOTH systems side by side: the reference system (`transferqueue==0.1.11`) and this
# repository's `tq-redis` (editable), plus matplotlib for the charts.
#
# Idempotent: re-running it only installs what is missing. Prints each step.
#
# Order matters:
#   1. torch==2.13.0 first. On these machines pip finds a CPU wheel of exactly that version on
#      local disk (/opt/wheels); an unpinned `torch` (asked for by tq-redis's `torch>=2.3`) with
#      no torch installed would instead pull a multi-GB CUDA build from PyPI. Once 2.13.0 is in,
#      every later range that 2.13.0 satisfies installs nothing more.
#   2. transferqueue==0.1.11 (the version the performance targets were measured against). It
#      brings ray[default], tensordict>=0.10, pyzmq, hydra-core, omegaconf, msgspec.
#   3. `pip install -e .` (tq-redis). Its ranges (tensordict>=0.6, numpy>=1.24, pyzmq>=25, ...)
#      overlap the reference's, so the resolver keeps what step 2 installed.
#   4. matplotlib for benchmarks/run_all.py's charts.
#
# Shared pins (BENCH_PINS below): both systems import tensordict and numpy in the same process,
# and a drift of either changes what is being measured, so we pin the versions this harness was
# verified with (`pip check` clean with both systems installed). Override with e.g.
#   TENSORDICT_VERSION=0.16.0 bash benchmarks/setup.sh
# if a newer one is needed; the script then re-checks with `pip check`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-bench}"
PYTHON="${PYTHON:-python3}"

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TQ_REF_VERSION="${TQ_REF_VERSION:-0.1.11}"
TENSORDICT_VERSION="${TENSORDICT_VERSION:-0.15.3}"
NUMPY_VERSION="${NUMPY_VERSION:-2.4.6}"
BENCH_PINS=("tensordict==${TENSORDICT_VERSION}" "numpy==${NUMPY_VERSION}")

say() { printf '[setup.sh] %s\n' "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating virtual environment $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
else
    say "virtual environment $VENV exists; reusing it"
fi
PIP=("$VENV/bin/python" -m pip)

# `pip show` exits 1 when the package is missing; print "" then.
installed_version() { { "$VENV/bin/python" -m pip show "$1" 2>/dev/null || true; } | awk '/^Version:/{print $2}'; }

have_torch="$(installed_version torch)"
if [[ "$have_torch" == "$TORCH_VERSION"* ]]; then
    say "torch $have_torch already installed"
else
    say "installing torch==$TORCH_VERSION first (CPU wheel from local disk; avoids a CUDA build)"
    "${PIP[@]}" install "torch==${TORCH_VERSION}"
fi

have_tq="$(installed_version transferqueue)"
if [[ "$have_tq" == "$TQ_REF_VERSION" ]]; then
    say "transferqueue $have_tq (reference system) already installed"
else
    say "installing the reference system transferqueue==$TQ_REF_VERSION with shared pins ${BENCH_PINS[*]}"
    "${PIP[@]}" install "transferqueue==${TQ_REF_VERSION}" "torch==${TORCH_VERSION}" "${BENCH_PINS[@]}"
fi

# An editable install records the source path; reinstall if it points elsewhere or if
# pyproject.toml, setup.py or a native module's source changed since the last install.
STAMP="$VENV/.tq-redis-pyproject.sha256"
native_sources=()
while IFS= read -r source; do native_sources+=("$source"); done < <(find "$ROOT/tq_redis" -name '*.c' | sort)
want_stamp="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "${native_sources[@]}" | sha256sum | cut -d' ' -f1)"
if { "$VENV/bin/python" -m pip show tq-redis 2>/dev/null || true; } | grep -q "Editable project location: $ROOT\$" \
    && [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" ]]; then
    say "tq-redis already installed editable from $ROOT (pyproject.toml, setup.py and native sources unchanged)"
else
    say "installing tq-redis (this repo) editable from $ROOT"
    "${PIP[@]}" install -e "$ROOT" "torch==${TORCH_VERSION}" "transferqueue==${TQ_REF_VERSION}" "${BENCH_PINS[@]}"
    echo "$want_stamp" > "$STAMP"
fi

if [[ -n "$(installed_version matplotlib)" ]]; then
    say "matplotlib $(installed_version matplotlib) already installed"
else
    say "installing matplotlib (charts)"
    "${PIP[@]}" install matplotlib "${BENCH_PINS[@]}"
fi

say "checking the environment for conflicts (pip check)"
"${PIP[@]}" check
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md

for name in ("torch", "transferqueue", "tq-redis", "tensordict", "numpy", "ray", "pyzmq", "matplotlib"):
    try:
        print(f"[setup.sh]   {name:14s} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"[setup.sh]   {name:14s} MISSING")
PY
say "done. Run the benchmarks with: $VENV/bin/python -m benchmarks --quick"
