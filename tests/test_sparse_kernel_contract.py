"""What the sparse kernel's ``mask_mod`` may capture, in the form each compiled flex template takes (issue 64).

A chunk's rows start at an offset, which the mask reads (`kernel_offset`). What each GPU template took on torch 2.11
(H100, docs/results/gpu_smoke/): the FLASH template (flash-attn-4 through Inductor's CuteDSL codegen) turns every
index of a captured load into a register value and fails on a constant one, so a captured 0-d tensor (index 0)
crashed every FLASH prefill ("Expected TensorSSA, but got int", daa89d9); a symbolic expression of the input sizes
(``k.shape[-2] - q.shape[-2]``) fails on both GPU templates ("Missing operation: index_expr" on FLASH,
"'ShapeAsConstantBuffer' object has no attribute 'dtype'" on Triton; 21403d1). CI has no GPU and no flash-attn-4:
these tests hold each form on the CPU, through the graph dynamo hands to the backend, where the template would
receive it, and check that the forms compute the same attention.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from flexentropy.sparse.kernel import _flex_over_table, kernel_offset, kernel_rows, pad_rows
from flexentropy.sparse.plan import SparsePlan, block_mask_tensors, causal_blocks

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Each test compiles the kernel's code object for its own backend: drop those entries after it, so that they
    count toward no recompile limit of the library's own compiled calls in later tests."""
    yield
    torch._dynamo.reset()


def mask_captures(fn: Callable[..., torch.Tensor], *args: object, dynamic: bool = True) -> list[object]:
    """What the ``mask_mod`` of every flex attention call in ``fn(*args)`` captures, as dynamo's graph hands it to
    the backend (compiled as the kernel is: ``dynamic=True``, one graph): the example values (tensors, SymInts)."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(gm)
        return gm.forward

    torch.compile(lambda *a: fn(*a), backend=record, dynamic=dynamic, fullgraph=True)(*args)
    calls = [node for gm in graphs
             for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.flex_attention)]
    assert calls, "no flex attention call in the graph"
    return [arg.meta["example_value"] if isinstance(arg, torch.fx.Node) else arg
            for node in calls for arg in node.args[8]]


def violations(captured: list[object], flash: bool) -> list[str]:
    """The captures a GPU template cannot take: a symbolic scalar other than a symbol of a captured tensor's size (the
    bound of a gather, which the templates do not compute with; anything else is arithmetic on a symbol, which
    neither template has), and on FLASH a tensor whose load index is a constant (0-d, or one element in every dim)."""
    sizes = {symbol for value in captured if isinstance(value, torch.Tensor)
             for size in value.shape if isinstance(size, torch.SymInt) for symbol in size.node.expr.free_symbols}
    bad = []
    for value in captured:
        if isinstance(value, torch.SymInt | torch.SymFloat) and value.node.expr not in sizes:
            bad.append(f"the symbolic scalar {value.node.expr}")
        elif flash and isinstance(value, torch.Tensor) and all(size == 1 for size in value.shape):
            bad.append(f"a tensor of shape {tuple(value.shape)}, read at a constant index")
    return bad


def kernel_call(n: int, q_start: int, template: str, offset: object = None) -> tuple[object, ...]:
    """The arguments `run_plan` hands its compiled region for a covering plan of the queries ``q_start .. n - 1``
    (CPU tensors), the offset in the form `kernel_offset` gives for the template (or ``offset``)."""
    gen = torch.Generator().manual_seed(n + q_start)
    q, k, v = (torch.randn(1, h, m, 64, generator=gen) for h, m in ((4, n - q_start), (2, n), (2, n)))
    blocks = causal_blocks(n, 128, q_start=q_start)[None, None].expand(1, 4, -1, -1).clone()
    start, blocks = kernel_rows(SparsePlan(blocks, n, 128, q_start=q_start))
    rows = pad_rows(q, q_start - start)
    if offset is None:
        offset = kernel_offset(start, rows.shape[-2], CPU, template)
    return rows, k, v, blocks, block_mask_tensors(blocks, n, 128, start), 128, None, None, False, offset


CHUNKS = [(1000, 0), (1000, 100), (1000, 384), (1000, 300), (1000, 999)]


@pytest.mark.parametrize("template", ["flash", "triton"])
@pytest.mark.parametrize(("n", "q_start"), CHUNKS)
def test_each_template_gets_an_offset_it_takes(n: int, q_start: int, template: str) -> None:
    """On FLASH whole prompts and chunks inside the first query block capture nothing and later chunks the rows'
    positions; on Triton every call captures one 0-d tensor (one graph for whole prompts and chunks)."""
    captured = mask_captures(_flex_over_table, *kernel_call(n, q_start, template))
    assert violations(captured, template == "flash") == []
    shapes = [tuple(value.shape) for value in captured if isinstance(value, torch.Tensor)]
    if template == "triton":
        assert shapes == [()]
    elif q_start < 128:
        assert shapes == []
    else:
        assert len(shapes) == 1 and len(shapes[0]) == 1


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_inside_an_outer_compile_a_chunk_gets_the_triton_form(dynamic: bool) -> None:
    """A model the user compiles whole, the chunk's start an int of the outer graph (a constant, or a symbol once
    dynamo makes it dynamic): the offset's 0-d tensor is made inside that graph, which Triton's template took on the
    GPU (FLASH's did not: `run_plan` sends such a chunk to Triton); a whole prompt captures nothing."""
    for q_start in (0, 384):
        args = kernel_call(1000, q_start, "triton", offset=0)
        start = q_start - q_start % 128

        def outer(*a: object) -> torch.Tensor:
            return _flex_over_table(*a[:-1], kernel_offset(a[-1], a[0].shape[-2], CPU, "triton")) * 1.0

        captured = mask_captures(outer, *args[:-1], start, dynamic=dynamic)
        assert violations(captured, flash=False) == []
        assert [tuple(value.shape) for value in captured] == ([] if q_start < 128 else [()])


def test_flash_is_left_for_triton_only_by_a_chunk_inside_an_outer_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_plan` asks for FLASH's options everywhere else: a whole prompt inside an outer compile keeps them."""
    import flexentropy.sparse.kernel as kernel

    seen: list[object] = []
    monkeypatch.setattr(kernel, "kernel_options", lambda backend, *rest: seen.append(backend) or (
        kernel.FLASH_OPTIONS if backend == "auto" else None))
    monkeypatch.setattr(kernel, "_compiled_flex_over_table",
                        lambda *a: seen.append(a[7]) or torch.zeros_like(a[0]))
    plan = SparsePlan(causal_blocks(1000, 128)[None, None].expand(1, 4, -1, -1).clone(), 1000, 128)
    q, k, v = torch.randn(1, 4, 1000, 64), torch.randn(1, 2, 1000, 64), torch.randn(1, 2, 1000, 64)
    kernel.run_plan(q, k, v, plan)
    chunk = SparsePlan(causal_blocks(1000, 128, q_start=384)[None, None].expand(1, 4, -1, -1).clone(), 1000, 128,
                       q_start=384)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    kernel.run_plan(q[..., :128, :], k[..., :128, :], v[..., :128, :], SparsePlan(plan.blocks[..., :1, :1], 128, 128))
    kernel.run_plan(q[..., 384:, :], k, v, chunk)
    assert seen == ["auto", kernel.FLASH_OPTIONS, "auto", kernel.FLASH_OPTIONS, "auto", "triton", None]


@pytest.mark.parametrize(("n", "q_start"), CHUNKS)
def test_the_forms_compute_the_same_attention(n: int, q_start: int) -> None:
    """The compiled CPU kernel with the FLASH forms (the rows' positions, or nothing) equals it with the 0-d form."""
    compiled = torch.compile(_flex_over_table, dynamic=True, fullgraph=True)
    flash, other = (compiled(*kernel_call(n, q_start, template)) for template in ("flash", "triton"))
    torch.testing.assert_close(flash, other, rtol=0, atol=0)


def test_the_check_flags_the_forms_that_failed_on_the_gpu() -> None:
    """daa89d9's 0-d tensor on FLASH, and 21403d1's size expression on both templates."""
    zero_d = torch.full((), 384, dtype=torch.int32)
    assert violations(mask_captures(_flex_over_table, *kernel_call(1000, 384, "flash", zero_d)), flash=True) == [
        "a tensor of shape (), read at a constant index"]

    def from_shapes(*args: object) -> torch.Tensor:
        q, k = args[0], args[1]
        return _flex_over_table(*args[:-1], k.shape[-2] - q.shape[-2])

    captured = mask_captures(from_shapes, *kernel_call(1000, 384, "flash", 0))
    for flash in (True, False):
        assert [v.split(" ")[1] for v in violations(captured, flash)] == ["symbolic"]
