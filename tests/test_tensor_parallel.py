"""flexentropy under transformers' tensor parallelism, on CPU: two processes (gloo) on tiny random models.

Each architecture's random checkpoint is saved once; ``tests/_tp_worker.py`` loads it on two ranks with
``DistributedConfig(tp_plan="auto")`` (q/k/v sharded by heads: each rank's attention sees 2 of the 4 query heads and
1 of the 2 KV heads) and this process loads it whole. The same `measure` runs in all three. Checks: at covering
budgets TP flexentropy generates TP dense's tokens (and the single process's); each rank's sparse prefill plans and
`LatentKVCache` entries are the single process's for the heads the rank holds (and a `StaticLatentKVCache` keeps the
same entries); and a rank's plan is exactly the single-process plan of the full-head inputs, restricted to its heads.
A prompt and a decode step make the same collective calls under flexentropy as dense. The sharding that would split
a head is refused by `enable`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from flexentropy.policies import make_prefill

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tp_worker import SMALL, SPLIT, VOCAB, measure  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=1, eos_token_id=None, pad_token_id=0)
ARCHS = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
         "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON))}  # qwen2: q/k/v biases, sharded with the heads
SPLIT_MODEL = {**COMMON, "num_key_value_heads": 1}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """``{arch: {"single": result, "ranks": [result of rank 0, rank 1]}}`` (`measure` results)."""
    root = tmp_path_factory.mktemp("tp")
    for arch, build in ARCHS.items():
        torch.manual_seed(0)
        build().eval().save_pretrained(root / arch)
    LlamaForCausalLM(LlamaConfig(**SPLIT_MODEL)).save_pretrained(root / SPLIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    worker = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={WORLD}", str(ROOT / "tests" / "_tp_worker.py"), str(root)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    singles = {}
    for arch in ARCHS:  # meanwhile, the single-process references
        model = AutoModelForCausalLM.from_pretrained(root / arch, dtype=torch.float32, attn_implementation="sdpa")
        singles[arch] = measure(model.eval())
    log, _ = worker.communicate(timeout=600)
    assert worker.returncode == 0, log[-4000:]
    return {arch: {"single": singles.get(arch),
                   "ranks": [torch.load(root / arch / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]}
            for arch in (*ARCHS, SPLIT)}


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_attends_over_its_own_whole_heads(runs: dict, arch: str) -> None:
    single, ranks = runs[arch]["single"], runs[arch]["ranks"]
    assert all(heads == ((0, 4), (0, 2)) for heads in single["heads"])
    for rank, result in enumerate(ranks):
        assert result["world_size"] == WORLD
        assert all(heads == ((2 * rank, 2 * rank + 2), (rank, rank + 1)) for heads in result["heads"])
        for layer, (query, key) in result["inputs"].items():  # what the attention function received
            assert query.shape[1] == 2 and key.shape[1] == 1, layer


@pytest.mark.parametrize("arch", ARCHS)
def test_flexentropy_adds_no_communication(runs: dict, arch: str) -> None:
    # per prompt and per step: an all-reduce after o_proj and down_proj of each layer and the embedding (5.24), and
    # the gathered logits; the sparse prefill and the evicting cache add none
    for result in runs[arch]["ranks"]:
        assert result["dense_collectives"]["gloo:all_reduce"] >= 2 * COMMON["num_hidden_layers"]
        assert result["sparse_collectives"] == result["dense_collectives"]
    assert not runs[arch]["single"]["dense_collectives"]


@pytest.mark.parametrize("arch", ARCHS)
def test_covering_budgets_generate_the_dense_tokens(runs: dict, arch: str) -> None:
    single, ranks = runs[arch]["single"], runs[arch]["ranks"]
    assert torch.equal(single["covering"], single["dense"])
    for result in ranks:
        assert torch.equal(result["dense"], single["dense"])  # TP dense = single-process dense
        assert torch.equal(result["covering"], result["dense"])  # TP flexentropy = TP dense
        assert result["covering_density"] == 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_ranks_plan_and_evict_their_heads_as_one_process_does(runs: dict, arch: str) -> None:
    single, ranks = runs[arch]["single"], runs[arch]["ranks"]
    assert sorted(single["plans"]) == [1, 2]  # layer 0 is dense
    for layer, plan in single["plans"].items():
        assert 0 < plan.density < 1
        parts = [result["plans"][layer] for result in ranks]
        # the ranks' inputs differ from the single process's by the rounding of the TP all-reduces (float32)
        assert torch.equal(torch.cat([p.blocks for p in parts], dim=1), plan.blocks), layer
        assert torch.equal(torch.cat([p.rigid for p in parts], dim=1), plan.rigid), layer
        for name in ("budgets", "entropy"):
            torch.testing.assert_close(torch.cat([getattr(p, name) for p in parts], dim=1), getattr(plan, name),
                                       rtol=1e-4, atol=1e-5)
    for layer, kept in single["kept"].items():
        assert torch.equal(torch.cat([result["kept"][layer] for result in ranks], dim=1), kept), layer
        stored, seen = single["stored"][layer]
        assert stored < seen  # evicted
        assert all(result["stored"][layer] == (stored, seen) for result in ranks)
    for result in (single, *ranks):  # the static cache takes the dynamic cache's decisions, on every rank
        assert torch.equal(result["static"], result["small"])
        for layer, kept in result["kept"].items():
            assert torch.equal(result["static_kept"][layer], kept), layer
    for result in ranks:
        assert torch.equal(result["small"], single["small"])


@pytest.mark.parametrize("arch", ARCHS)
def test_a_ranks_plan_is_the_full_plan_of_its_heads(runs: dict, arch: str) -> None:
    # from identical inputs: the plan of all heads (one process), restricted to a rank's heads, is the rank's plan
    ranks = runs[arch]["ranks"]
    policy = make_prefill("entropy", SMALL)
    for layer in ranks[0]["plans"]:
        query = torch.cat([result["inputs"][layer][0] for result in ranks], dim=1)
        key = torch.cat([result["inputs"][layer][1] for result in ranks], dim=1)
        full = policy.plan(query, key, layer)
        for rank, result in enumerate(ranks):
            heads = slice(*result["heads"][layer][0])
            part = result["plans"][layer]
            for name in ("blocks", "rigid", "budgets", "entropy"):
                assert torch.equal(getattr(part, name), getattr(full, name)[:, heads]), (layer, rank, name)


def test_enable_refuses_a_sharding_that_splits_a_head(runs: dict) -> None:
    # one KV head over two ranks: transformers' colwise plan gives each rank half of its rows
    for result in runs[SPLIT]["ranks"]:
        assert "k_proj has 1 heads, which 2 tensor-parallel ranks cannot share" in result["refused"]
