#!/usr/bin/env bash
# The H200 results of docs/quality.md: the same model, text and commands as run_cpu.sh, more samples per cell and
# every length of SmolLM2's useful range (1k-4k). The grids are the lines of h200.plan, run in one process (the model
# is loaded and its kernels compiled once). Results land in docs/results/quality_h200/ (same layout), or in $RESULTS.
# Resumable: a run cut off by a time limit is finished by running this again.
set -euo pipefail
cd "$(dirname "$0")/../.."
export RESULTS=${RESULTS:-docs/results/quality_h200} SAMPLES=${SAMPLES:-24}
python3 -m flexentropy.eval plan profiling/quality/h200.plan
python3 -m flexentropy.eval report --runs "$RESULTS/runs" --out "$RESULTS"
