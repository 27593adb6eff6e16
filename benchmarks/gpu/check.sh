#!/usr/bin/env bash
# The GPU check (benchmarks/gpu/README.md): check.sh [--out DIR] [--dry-run]
# Installs this checkout of pipeweave without dependencies (not in a dry run), the solvers from .whl/ when that
# folder holds their wheels, then runs benchmarks/gpu/check.py. PYTHON picks the interpreter (default python).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-python}"
dry=0
for arg in "$@"; do [[ "$arg" == "--dry-run" ]] && dry=1; done
cd "$repo"
if [[ $dry == 0 ]]; then
    "$python" -m pip install --quiet --no-deps -e .
    if compgen -G ".whl/*.whl" > /dev/null; then
        "$python" -m pip install --quiet --no-index --find-links .whl ortools highspy \
            || echo "gpu check: the wheels in .whl/ did not install; going on without the solvers" >&2
    fi
fi
exec "$python" benchmarks/gpu/check.py "$@"
