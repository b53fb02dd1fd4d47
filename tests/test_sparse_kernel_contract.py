"""What the sparse kernel's ``mask_mod`` may capture, in the form each compiled flex template takes (issue 64).

The FLASH template (flash-attn-4 through Inductor's CuteDSL codegen, torch 2.11) indexes every load a ``mask_mod``
makes with a value of the row or column: a captured 0-d tensor's load has the constant index 0, and the kernel fails
to build ("Expected TensorSSA, but got int"); a captured scalar that is not a size of the inputs is refused. So on
CUDA the kernel's mask may read nothing but the sizes of its inputs. CI has no GPU and no flash-attn-4: these tests
hold the form on the CPU, through the graph dynamo hands to the backend, where the template would receive it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._dynamo.source import TensorPropertySource

from flexentropy.sparse.kernel import _flex_over_table, kernel_offset, kernel_rows, pad_rows
from flexentropy.sparse.plan import SparsePlan, block_mask_tensors, causal_blocks

CUDA = torch.device("cuda")


def mask_captures(fn: Callable[..., torch.Tensor], *args: object) -> list[object]:
    """What the ``mask_mod`` of every flex attention call in ``fn(*args)`` captures, as dynamo's graph hands it to
    the backend (compiled as the kernel is: ``dynamic=True``, one graph): the example values (tensors, SymInts)."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return gm.forward

    torch.compile(lambda *a: fn(*a), backend=record, dynamic=True, fullgraph=True)(*args)
    captured = []
    for gm in graphs:
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.flex_attention):
            captured += [arg.meta["example_value"] if isinstance(arg, torch.fx.Node) else arg for arg in node.args[8]]
    assert graphs and captured is not None
    return captured


def flash_violations(captured: list[object]) -> list[str]:
    """The captures the FLASH template cannot take: any tensor, and any scalar symbol that is not an input's size."""
    bad = []
    for value in captured:
        if isinstance(value, torch.Tensor):
            bad.append(f"a tensor of shape {tuple(value.shape)}")
        elif isinstance(value, torch.SymInt):
            env = value.node.shape_env
            for symbol in value.node.expr.free_symbols:
                if not any(isinstance(s, TensorPropertySource) for s in env.var_to_sources.get(symbol, [])):
                    bad.append(f"the scalar {symbol}, not a size of the inputs")
    return bad


def kernel_call(n: int, q_start: int, offset_device: torch.device) -> tuple[object, ...]:
    """The arguments `run_plan` hands its compiled region for a covering plan of the queries ``q_start .. n - 1``
    (CPU tensors), with the offset in the form `kernel_offset` gives on ``offset_device``."""
    gen = torch.Generator().manual_seed(n + q_start)
    q, k, v = (torch.randn(1, h, m, 64, generator=gen) for h, m in ((4, n - q_start), (2, n), (2, n)))
    blocks = causal_blocks(n, 128, q_start=q_start)[None, None].expand(1, 4, -1, -1).clone()
    start, blocks = kernel_rows(SparsePlan(blocks, n, 128, q_start=q_start))
    tensors = block_mask_tensors(blocks, n, 128, start)
    return (pad_rows(q, q_start - start), k, v, blocks, tensors, 128, None, None, False,
            kernel_offset(start, offset_device))


@pytest.mark.parametrize(("n", "q_start"), [(1000, 0), (1000, 384), (1000, 300), (1000, 999)])
def test_the_cuda_kernel_mask_captures_only_input_sizes(n: int, q_start: int) -> None:
    """Whole prompts and chunks at an offset (on and off the 128 grid), as the compiled region sees them."""
    assert kernel_offset(q_start, CUDA) is None
    assert flash_violations(mask_captures(_flex_over_table, *kernel_call(n, q_start, CUDA))) == []


def test_inside_an_outer_compile_the_cuda_kernel_mask_captures_only_input_sizes() -> None:
    """A model the user compiles whole: the kernel's region is traced into the outer graph."""
    for q_start in (0, 384):
        args = kernel_call(1000, q_start, CUDA)
        assert flash_violations(mask_captures(lambda *a: _flex_over_table(*a) * 1.0, *args)) == []


def test_the_check_flags_the_form_that_crashed_the_flash_template() -> None:
    """daa89d9's offset, a 0-d device tensor, which the CPU kernel still takes: the check above must see it."""
    captured = mask_captures(_flex_over_table, *kernel_call(1000, 384, torch.device("cpu")))
    assert flash_violations(captured) == ["a tensor of shape ()"]
