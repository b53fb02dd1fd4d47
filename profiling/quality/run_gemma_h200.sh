#!/usr/bin/env bash
# The second model of docs/quality.md on the H200: the grids of gemma_h200.plan (Gemma-3-270m at 8k-16k tokens), in
# one process. Results land in docs/results/gemma3_h200/ (or $RESULTS). Resumable.
set -euo pipefail
cd "$(dirname "$0")/../.."
export RESULTS=${RESULTS:-docs/results/gemma3_h200} SAMPLES=${SAMPLES:-24}
export GEMMA3_GGUF=${GEMMA3_GGUF:-/tmp/gemma3/gemma-3-270m-q4_k_m.gguf}
python3 -m flexentropy.eval plan profiling/quality/gemma_h200.plan
python3 -m flexentropy.eval report --runs "$RESULTS/runs" --out "$RESULTS"
