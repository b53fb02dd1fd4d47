"""Quality evaluation on a real model: RULER-style tasks over Paul Graham's essays and Python sources, resumable
runs of every prefill and cache policy, attention fidelity on the model's own q/k/v, and the paper's entropy maps.

Run it with ``python -m bench.eval`` (`bench.eval.commands`); results and their reading: ``docs/quality.md``.
The task generators and metrics need no model; the rest imports transformers when it runs.
"""

from bench.eval.metrics import (
    common_prefix_tokens,
    string_match_all,
    string_match_part,
    value_hits,
    wilson_interval,
)
from bench.eval.tasks import PLACEMENTS, TASKS, Sample, Turn, make_sample, prompt_text, sample_ids

__all__ = [
    "PLACEMENTS",
    "TASKS",
    "Sample",
    "Turn",
    "common_prefix_tokens",
    "make_sample",
    "prompt_text",
    "sample_ids",
    "string_match_all",
    "string_match_part",
    "value_hits",
    "wilson_interval",
]
