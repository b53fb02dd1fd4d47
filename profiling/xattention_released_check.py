"""Why the released XAttention estimate selects so few blocks in `profiling/peers.py` (docs/performance.md).

Runs the released ``xattn_estimate`` (its PyTorch path, ``use_triton=False``, the one `peers.py` can call on an
H200) on the CPU beside flexentropy's `antidiagonal_block_mass`, on the same random q/k, once with one query chunk
(``chunk_size = N``) and once with four. The released file is copied to a temporary folder with its ``"cuda"``
device strings replaced by ``"cpu"`` and its Triton/``block_sparse_attn`` imports stubbed (neither is used by the
PyTorch path); nothing of it enters this repository::

    profiling/fetch_peers.sh official && python profiling/xattention_released_check.py --official official
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch

from flexentropy.policies.prefill.xattention import antidiagonal_block_mass
from flexentropy.sparse.plan import causal_blocks


def load_released(folder: Path) -> types.ModuleType:
    tmp = Path(tempfile.mkdtemp())
    shutil.copytree(folder / "x-attention" / "xattn", tmp / "xattn")
    for name in ("Xattention.py", "utils.py"):
        path = tmp / "xattn" / "src" / name
        path.write_text(path.read_text().replace('"cuda"', '"cpu"'))
    stub = types.ModuleType("xattn.src.kernels")
    stub.__getattr__ = lambda name: None  # the Triton kernels: unused by the PyTorch path
    sys.modules["xattn.src.kernels"] = stub
    sys.modules["block_sparse_attn"] = types.SimpleNamespace(block_sparse_attn_func=None)
    sys.path.insert(0, str(tmp))
    import xattn.src.Xattention as released

    return released


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--official", type=Path, required=True, help="folder holding x-attention/ (fetch_peers.sh)")
    args = p.parse_args()
    released = load_released(args.official)
    torch.manual_seed(0)
    n, heads, dim, row = 4096, 2, 64, 20
    q, k = torch.randn(1, heads, n, dim), torch.randn(1, heads, n, dim)
    blocks = n // 128
    causal = causal_blocks(n, 128)
    ours = antidiagonal_block_mass(q, k, 8, 128)[0, 0, row, : row + 2]
    print(f"N={n}, 2 heads, D {dim}, stride 8, threshold 0.9; query block {row}'s block scores (first {row + 2}):")
    print(f"  flexentropy          {[round(x, 2) for x in ours.tolist()]}")
    for chunk in (n, n // 4):
        sums, masks = released.xattn_estimate(q, k, block_size=128, stride=8, threshold=0.9, chunk_size=chunk,
                                              use_triton=False, causal=True)
        density = float((masks[:, :, :blocks, :blocks] & causal).sum() / (causal.sum() * heads))
        scores = [round(x, 2) for x in sums[0, 0, row, : row + 2].tolist()]
        print(f"  released, chunk {chunk:5d} {scores}  density {density:.3f}")


if __name__ == "__main__":
    main()
