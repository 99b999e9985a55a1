#!/usr/bin/env bash
# The Python environment of the tests: a virtual environment with torch,
# scikit-learn, numpy and pytest, created once and cached outside the clone
# (torch's Linux wheels are large). Prints its path. Usable by hand.
set -euo pipefail
VENV="${EPS_VENV:-/var/cache/eps-venv}"
if "$VENV/bin/python" -c "import torch, sklearn, numpy, pytest" 2>/dev/null; then
    echo "$VENV"
    exit 0
fi
if ! python3 -m venv --help >/dev/null 2>&1; then
    echo "installing python3-venv" >&2
    apt-get update -qq -o DPkg::Lock::Timeout=300 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 python3-venv >&2
fi
echo "creating $VENV (torch, scikit-learn, numpy, pytest; several GB the first time)" >&2
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV" >&2
"$VENV/bin/pip" install -q --upgrade pip >&2
"$VENV/bin/pip" install -q torch scikit-learn numpy pytest >&2
echo "$VENV"
