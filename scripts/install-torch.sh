#!/usr/bin/env bash
# Install torch into a virtual environment as a CPU build: `make venv` runs it before the package.
#
#   scripts/install-torch.sh PYTHON       PYTHON: the venv's interpreter, e.g. .venv/bin/python
#
# TORCH_SPEC    the requirement (default torch==2.13.0), e.g. 'torch>=2.11'
# TORCH_INDEX   the index to take torch from when no local wheel fits
#               (default https://download.pytorch.org/whl/cpu, PyTorch's CPU builds); "pip": the
#               indexes pip's own configuration names, whatever build they hold (CI's torch
#               compatibility run takes a CUDA build that also runs on the CPU from a local mirror)
# TORCH_DRY_RUN 1: ask pip what it would install (--dry-run), install nothing
#
# In order: torch already installed and matching TORCH_SPEC, or a wheel that pip's own configuration
# offers locally (find-links, e.g. /opt/wheels), is used without contacting any index; otherwise
# torch comes from TORCH_INDEX, never from PyPI's default build (CUDA, GBs). When TORCH_INDEX does
# not answer within 10 s, it stops at once with the command to run.
set -euo pipefail

PY=${1:?usage: scripts/install-torch.sh PYTHON (the venv interpreter)}
SPEC=${TORCH_SPEC:-torch==2.13.0}
INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
DRY=()
[ "${TORCH_DRY_RUN:-}" = 1 ] && DRY=(--dry-run)
say() { printf 'install-torch: %s\n' "$*" >&2; }

[ -x "$PY" ] || { say "$PY is not an interpreter; pass the venv's python, e.g. .venv/bin/python"; exit 2; }

# 1. Installed already, or a local wheel from pip's configuration: no index is asked (--no-index),
#    so this answers at once. torch's own dependencies (small) then come from the usual indexes.
if "$PY" -m pip install -q --no-index --no-deps "${DRY[@]}" "$SPEC" 2>/dev/null; then
    say "$SPEC: installed or from a local wheel (pip's find-links)"
    "$PY" -m pip install -q "${DRY[@]}" "$SPEC"
    exit 0
fi

if [ "$INDEX" = pip ]; then
    say "$SPEC from pip's configured indexes"
    "$PY" -m pip install -q "${DRY[@]}" "$SPEC"
    exit 0
fi

# 2. The CPU index, if it answers. The probe is bounded; pip's own retries would take minutes.
if ! "$PY" - "$INDEX" <<'EOF'
import sys
import urllib.request

url = sys.argv[1].rstrip("/") + "/torch/"
try:
    with urllib.request.urlopen(url, timeout=10) as response:
        response.read(1)
except Exception as exc:  # noqa: BLE001 - any failure means: not reachable from here
    sys.exit(f"install-torch: {url} does not answer ({type(exc).__name__}: {exc})")
EOF
then
    say "no local wheel fits '$SPEC' and $INDEX does not answer; run: make venv TORCH_INDEX=<a mirror of $INDEX that answers here>"
    exit 1
fi
say "$SPEC from $INDEX"
"$PY" -m pip install -q "${DRY[@]}" --index-url "$INDEX" "$SPEC"
