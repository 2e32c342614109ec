#!/usr/bin/env bash
# The GPU check in one command (bench/gpu_check.py says what each row measures): prints one JSON record and writes
# it to $OUT/gpu_check.json where OUT is set (the device machine), else bench/results/gpu_check.json. Needs no network:
# Python packages the machine lacks travel as wheels in .whl/ (`make gpu-wheels`), installed here into /tmp/site.
# Exit 0 whenever the record was written; each row that could not run says why inside it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-bench/results}
exec "$PY" -m bench.gpu_check --out "$out/gpu_check.json" "$@"
