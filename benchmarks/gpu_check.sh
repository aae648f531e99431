#!/usr/bin/env bash
# The prepared GPU check (issue 14): the small and base presets alone for 300 steps each, then a
# 2-peer region of the small preset on the same GPU (benchmarks/gpu_check.py says what it prints).
# Under 8 minutes on one H200-class GPU; on a fresh machine it sets up .venv first (CUDA torch).
#   bash benchmarks/gpu_check.sh                 # on a machine with a GPU
#   bash benchmarks/gpu_check.sh --device cpu --presets tiny --steps 20 --swarm-preset tiny \
#        --swarm-steps 20 --inner-steps 10      # the script checking itself, without a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e .
fi
exec timeout 470 .venv/bin/python benchmarks/gpu_check.py "$@"
