#!/usr/bin/env bash
# Idempotent environment setup shared by the README's two commands: a .venv in the repository with
# torch 2.13 (CPU build, installed first and pinned: any other spec pulls the CUDA wheels), then
# this package with its test extra from pyproject.toml (deepspeed 0.19.x, megatron-core, triton, pytest,
# mkdocs and mkdocstrings for the docs-site test, ...). It installs and sets nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
