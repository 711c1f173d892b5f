#!/usr/bin/env bash
# Writes .gpu/extra/: the wheels the GPU check's serve step (its httpx client) and the
# README's openai example need beyond what ../shared/gpu/prepare fetches (the GPU machine
# has no network). Run here after ../shared/gpu/prepare; carry .gpu/extra with the second
# call, and scripts/gpu_check.sh installs them before its steps.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .gpu/extra && mkdir -p .gpu/extra
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .gpu/extra openai httpx 2>&1 | grep -v '^WARNING' || true
du -sh .gpu/extra && ls .gpu/extra
