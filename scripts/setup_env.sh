#!/bin/sh
# Create the virtual environment and install mlx-engine with its test extra.
# On Linux as root, also install OpenBLAS (MLX's CPU wheel ships reference BLAS; see README).
set -eu
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ "$(uname -s)" = "Linux" ] && ! ldconfig -p 2>/dev/null | grep -q libopenblas.so.0; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing libopenblas0-pthread (fast fp32 matmul for MLX on CPU)"
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null
    else
        echo "note: libopenblas0-pthread not found; MLX will use its slow reference BLAS" >&2
    fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[test]"
