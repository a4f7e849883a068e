#!/usr/bin/env bash
# Download the pure-Python wheels the GPU machine lacks (it has no network) into .whl/, which
# `run` carries (carry: [".whl"]) and scripts/gpu_run.sh installs with --no-deps. The GPU image
# has torch, triton, transformers, numpy, pandas, pyyaml, requests, pytest and hypothesis.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing rpds-py \
  skyrl-gym==0.4.0 omegaconf==2.4.0
# func-timeout is published as a source archive only: build its (pure-Python) wheel here
python3 -m pip wheel -q --no-deps -w .whl func-timeout==4.3.5
ls .whl
