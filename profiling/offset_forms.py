"""Which forms of a chunk's offset the compiled flex templates of this torch take (issue 64), on one chunk.

    python profiling/offset_forms.py --out docs/results/gpu_smoke/offset_forms.jsonl

A chunk of the queries from the middle of a ``--length``-token prompt (structured inputs, the Llama-3.1-8B head
shape, bf16) runs through the sparse kernel's compiled region (`flexentropy.sparse.kernel._flex_over_table`) over
every causal block, once per form of the offset its ``mask_mod`` reads (`flexentropy.sparse.plan.query_position`),
on each template: the rows' positions as a vector sized with the rows (what `kernel_offset` gives FLASH), the same
vector of a fixed length, a vector of two read at ``(q // 128) % 2``, and the 0-d tensor (what Triton and the CPU
get, and what crashed FLASH at daa89d9). One JSON line per form and template: its relative error against SDPA's
causal attention, or the error the template raised. The GPU's answer to what tests/test_sparse_kernel_contract.py
holds on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import attention_inputs, environment  # noqa: E402

import flexentropy.sparse.plan as plan_module  # noqa: E402
from flexentropy._compile import keep_dynamic  # noqa: E402
from flexentropy.sparse.kernel import FLASH_OPTIONS, _flex_over_table, kernel_options, kernel_rows, pad_rows  # noqa: E402
from flexentropy.sparse.plan import SparsePlan, block_mask_tensors, causal_blocks  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--out", type=Path, default=Path("docs/results/gpu_smoke/offset_forms.jsonl"))
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    n, q_start = args.length, args.length // 2 + 300
    q, k, v = attention_inputs(1, 32, 8, n, 128, torch.bfloat16, dev, kind="structured")
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[..., q_start:, :]
    blocks = causal_blocks(n, 128, dev, q_start=q_start)[None, None].expand(1, 32, -1, -1).clone()
    start, blocks = kernel_rows(SparsePlan(blocks, n, 128, q_start=q_start))
    rows = pad_rows(q[..., q_start:, :], q_start - start)
    tensors = block_mask_tensors(blocks, n, 128, start)
    keep_dynamic(*tensors[0::2], dims=(-1,))
    keep_dynamic(*tensors[1::2], dims=(-2, -1))
    span = -(-rows.shape[-2] // 128) * 128 + 128

    def vector() -> torch.Tensor:
        positions = torch.arange(start, start + span, dtype=torch.int32, device=dev)
        keep_dynamic(positions, dims=(0,))
        return positions

    def fixed_vector() -> torch.Tensor:
        positions = torch.arange(start, start + (1 << 20), dtype=torch.int32, device=dev)
        torch._dynamo.mark_static(positions, 0)
        return positions

    forms: dict[str, Callable[[], torch.Tensor]] = {
        "positions": vector, "positions_fixed_length": fixed_vector,
        "pair": lambda: torch.full((2,), start, dtype=torch.int32, device=dev),
        "zero_d": lambda: torch.full((), start, dtype=torch.int32, device=dev)}
    original = plan_module.query_position

    def with_pair(q_idx: torch.Tensor, offset: int | torch.Tensor) -> torch.Tensor:
        if isinstance(offset, torch.Tensor) and offset.dim() == 1 and offset.shape[0] == 2:
            return q_idx + offset[(q_idx // 128) % 2]
        return original(q_idx, offset)

    plan_module.query_position = with_pair
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    with args.out.open("w", encoding="utf-8") as out:
        for template, options in (("flash", FLASH_OPTIONS), ("triton", kernel_options("triton", dev, 128))):
            for name, make in forms.items():
                torch._dynamo.reset()
                kernel = torch.compile(_flex_over_table, dynamic=True, fullgraph=True)
                began = time.perf_counter()
                row = {"template": template, "form": name, "length": n, "q_start": q_start, **env}
                try:
                    got = kernel(rows, k, v, blocks, tensors, 128, None, options, False, make())
                    err = float((got[..., q_start - start:, :].float() - dense.float()).norm() / dense.float().norm())
                    row |= {"ok": err < 0.02, "rel_err": err}
                except Exception as error:  # noqa: BLE001 - each form's failure is the finding
                    row |= {"ok": False, "error": f"{type(error).__name__}: {error}"[:400]}
                row["seconds"] = round(time.perf_counter() - began, 1)
                out.write(json.dumps(row) + "\n")
                print(json.dumps(row)[:300], flush=True)


if __name__ == "__main__":
    main()
