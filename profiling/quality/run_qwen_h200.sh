#!/usr/bin/env bash
# Issue 16's H200 runs on Qwen2.5-Coder-1.5B (profiling/quality/qwen_h200.plan), after `source profiling/h200/setup.sh`
# has joined the model in /tmp/m. Resumable: a call cut off by its time limit is finished by the next one. The run
# folders are packed into $OUT/qwen_runs.tar.xz (the device returns files two folders deep at most).
set -uo pipefail
cd "$(dirname "$0")/../.."
export MODEL=${MODEL:-/tmp/m/qwen2.5-coder-1.5b.gguf} RESULTS=${RESULTS:-/tmp/qwen16} PLAN=${PLAN:-profiling/quality/qwen_h200.plan}
if [ ! -d "$RESULTS/runs" ]; then   # the committed runs the plans pair with, so that finished cells are skipped
  mkdir -p "$RESULTS" && tar -xJf docs/results/qwen_h200/runs.tar.xz -C "$RESULTS" \
    runs/qwen2.5-coder-1.5b/niah_multikey/32768/q-outside/dense__full
  for study in qwen_h200_seg256 qwen_h200_s9 qwen_h200_s13 qwen_h200_s14; do tar -xJf "docs/results/$study/runs.tar.xz" -C "$RESULTS"; done
fi
timeout "${LIMIT:-540}" python3 -m flexentropy.eval plan "$PLAN"
python3 -m flexentropy.eval report --runs "$RESULTS/runs" --out "$RESULTS" > /dev/null
if [ -n "${OUT:-}" ]; then
  tar -cJf "$OUT/qwen_runs.tar.xz" -C "$RESULTS" runs && cp "$RESULTS"/*.md "$RESULTS"/*.csv "$OUT"/ 2>/dev/null
  cat "$RESULTS"/tables.md | tail -30
fi
