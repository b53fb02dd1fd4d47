"""GPU check of the probe observation's flex kernel (opt-in) against its scored path: the masses must agree.

    python profiling/quality/probe_kernel_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flexentropy.prefill.estimate import probe_block_mass  # noqa: E402

gen = torch.Generator(device="cuda").manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    q = torch.randn(1, 8, 20000, 128, device="cuda", generator=gen).to(dtype)
    k = torch.randn(1, 2, 20000, 128, device="cuda", generator=gen).to(dtype)
    fast = probe_block_mass(q, k, 512, 128, 16, kernel=True)
    slow = probe_block_mass(q, k, 512, 128, 16, kernel=False)
    print(f"{dtype}: max |kernel - scored| = {float((fast - slow).abs().max()):.3g}, "
          f"row sums {float(fast.sum(-1).min()):.4f}..{float(fast.sum(-1).max()):.4f}")
