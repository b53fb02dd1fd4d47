"""GPU check of the probe observation's flex kernel (`probe_mass_kernel`) against the scored path: same masses.

    python profiling/quality/probe_kernel_check.py [cpu]   # cpu: eager flex, a smoke run of the script

Exits 1 when a float32 case differs by more than 1e-4 or a probe's masses do not sum to 1 (bf16 within 1e-2), so a
device call can pick the path of the runs after it. Cases: segments of 512 and 256, one kernel call and several
(`PROBE_KERNEL_OUTPUTS` cut down, so that later calls start at a probe row other than 0), float32 and bfloat16.

History: sessions 7-8 found rows summing to 0.715 on the H200. Session 9 compared the kernel's raw output and
log-sum-exp per key chunk with dense scores (docs/results/gpu_sessions.md, session9): exact with the BlockMask built
eagerly, whether flex was compiled with static or dynamic shapes, with or without full blocks. The mass was lost
only when the BlockMask was built inside the compiled graph; it is now built eagerly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest.mock import patch

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flexentropy.policies.prefill.entropy import probe_mass  # noqa: E402

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
BLOCK, PROBES = 128, 16
CASES = (  # N, segment size, dtype, kernel outputs per call (None: the library's)
    (20000, 512, torch.float32, None),
    (20000, 256, torch.float32, 2**16),
    (33000, 256, torch.bfloat16, None),
    (33000, 256, torch.bfloat16, 2**18),
)

failed = False
for n, segment, dtype, outputs in CASES:
    gen = torch.Generator(device=DEVICE).manual_seed(n + segment)
    q = torch.randn(1, 8, n, 128, device=DEVICE, generator=gen).to(dtype)
    k = torch.randn(1, 2, n, 128, device=DEVICE, generator=gen).to(dtype)
    with patch.object(probe_mass, "PROBE_KERNEL_OUTPUTS", outputs or probe_mass.PROBE_KERNEL_OUTPUTS):
        fast = probe_mass.probe_block_mass(q, k, segment, BLOCK, PROBES, kernel=True)
    slow = probe_mass.probe_block_mass(q, k, segment, BLOCK, PROBES, kernel=False, compiled=DEVICE == "cuda")
    diff = float((fast - slow).abs().max())
    sums = fast.sum(-1)
    low, high = float(sums.min()), float(sums.max())
    ok = (diff <= 1e-4 if dtype == torch.float32 else True) and max(1 - low, high - 1) <= (
        1e-4 if dtype == torch.float32 else 1e-2)
    failed |= not ok
    calls = "several calls" if outputs else "one call"
    print(f"{'ok  ' if ok else 'FAIL'} N {n}, segments {segment}, {str(dtype)[6:]:8s} {calls:13s}: "
          f"max |kernel - scored| {diff:.3g}, row sums {low:.4f}..{high:.4f}", flush=True)
sys.exit(1 if failed else 0)
