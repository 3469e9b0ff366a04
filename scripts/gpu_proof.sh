#!/usr/bin/env bash
# The GPU proof (issue 35) on a lent GPU machine, from the repository root, in one call:
#
#   bash scripts/gpu_proof.sh                     # every stage, --budget-s 420, results in $OUT
#   bash scripts/gpu_proof.sh --rows fold,sd --budget-s 200    # a second try at the stages that failed
#
# The machine reaches no package index: the wheels it lacks travel in .whl/ (`make gpu-deps` here, then name
# .whl in the call's carry) and are installed into $GPU_PROOF_SITE. The checkout becomes the `lowmem` namespace
# through a folder of links, one per [tool.setuptools.package-dir] entry of pyproject.toml (no pip install of the
# project: no index, and the machine's setuptools may be older than pyproject.toml needs). Any extra arguments go
# to `suite bench gpu`; docs/benchmarks.md ("GPU proof: how to run") has the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/gpu-proof}"
SITE="${GPU_PROOF_SITE:-/tmp/site}"
NS="${GPU_PROOF_NS:-/tmp/lowmem-ns}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
rm -rf "$NS" && mkdir -p "$NS/lowmem"
"$PY" - "$NS/lowmem" <<'PYEOF'
import os, sys, tomllib
with open("pyproject.toml", "rb") as f:
    folders = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
for name, folder in folders.items():  # lowmem.kernels -> ./kernels, ...
    os.symlink(os.path.abspath(folder), os.path.join(sys.argv[1], name.split(".", 1)[1]))
PYEOF
export PYTHONPATH="$NS:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec "$PY" -m lowmem.suite bench gpu --out "$OUT" --budget-s 420 "$@"
