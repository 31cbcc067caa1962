#!/usr/bin/env bash
# The GPU check (tests/gpu/check.py): tests/gpu/check.sh DIR [--dry] [--only STEP,...]
# PYTHON: the interpreter with the machine's torch (python3); GPU_WHEELS: the wheel folder
# `make gpu-wheels` prepared (build/gpu-wheels).
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/check.py" "$@"
