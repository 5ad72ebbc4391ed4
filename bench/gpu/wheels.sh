#!/usr/bin/env bash
# Wheels for the packages in bench/gpu/requirements.txt, for the device machine's Python
# 3.12 on x86-64, into bench/gpu/wheels/ (git-ignored; carried to the device explicitly).
# Binary wheels where PyPI has them; a pure-Python package published only as an sdist is
# built here into a py3-none-any wheel.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
DEST=bench/gpu/wheels
mapfile -t packages < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' bench/gpu/requirements.txt | grep -v '^$' || true)
if ((${#packages[@]} == 0)); then
  echo "bench/gpu/requirements.txt names no package: no wheels to build"
  exit 0
fi
mkdir -p "$DEST"
for package in "${packages[@]}"; do
  if ! "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DEST" \
      --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any "$package"; then
    "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$DEST" "$package"
  fi
done
ls -l "$DEST"
