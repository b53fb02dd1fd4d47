#!/usr/bin/env bash
# The H200 results of docs/quality.md: the same model, text and commands as run_cpu.sh, more samples per cell
# and every length of SmolLM2's useful range (1k-4k). Results land in docs/results/quality_h200/ (same layout).
# Steps are in priority order and resumable: a run cut off by a time limit is finished by running this again.
set -euo pipefail
cd "$(dirname "$0")/../../.."
RESULTS=${RESULTS:-docs/results/quality_h200}
E="python3 -m flexentropy.eval"
# 8 samples per left-padded batch (the same tokens as one by one in the CPU tests; caches neither score nor keep
# the padding); `bounded` runs would go one by one.
R="$E run --device cuda --out $RESULTS/runs --batch-size 8"
SAMPLES=${SAMPLES:-24}

# 1. Prefill policies at matched B_0 (full cache), every length: accuracy against measured density.
$R --tasks niah_single --lengths 2048 3072 4096 --prefill dense entropy critiprefill streaming \
    --prefill-budgets 64 128 256 --samples "$SAMPLES"

# 2. Cache policies at B_d 64-1024 (dense prefill), question after (outside) and before (inside) the context.
$R --tasks niah_multivalue niah_single --lengths 2048 --placements outside inside \
    --cache full latent snapkv adakv streamingllm --cache-budgets 64 128 1024 --samples "$SAMPLES"

# 3. Which tasks the model can do at all (dense), then every prefill x cache at B_0 = B_d = 128.
$R --tasks niah_single niah_multikey niah_multivalue niah_multiquery vt cwe --lengths 1024 2048 3072 4096 \
    --samples "$SAMPLES"
$R --tasks niah_multivalue --lengths 2048 --prefill dense entropy critiprefill streaming \
    --cache full latent snapkv adakv streamingllm --prefill-budgets 128 --cache-budgets 128 --samples "$SAMPLES"

# 4. The paper's latency prompt (summarise, 100 new tokens) on the GPU; one by one, so that times are per sample.
$R --tasks summarise --lengths 4096 --prefill dense entropy --cache full latent --prefill-budgets 128 \
    --cache-budgets 128 --samples 4 --batch-size 1

# 5. Tables and plots.
$E report --runs "$RESULTS/runs" --out "$RESULTS"
