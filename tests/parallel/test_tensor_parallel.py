"""The model split over 2 CPU ranks (gloo) against the model in one process, on the tiny V4, V4.1 and
FP8 V4 (kept packed): logits within the noise of a reordered reduction, the vocabulary-parallel
embedding exact, and each rank holding half of the split tensors' bytes."""

from __future__ import annotations

import hashlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from engine.parallel.group import Rendezvous, init_group
from engine.parallel.plans import resident_bytes
from model.attention import Indexer
from model.attention_v41 import Indexer41
from model.checkpoint import load_model, plan_shard, stored_tensors
from model.parallel.context import ParallelContext
from model.testing.tiny import cached_tiny
from tests.parallel.conftest import two_ranks

WORLD = 2
ARCHS = ("v4", "v41")
CASES = (*ARCHS, "v4-fp8")
PROMPT = [0, 17, 4000, 5, 5, 93, 2048, 311, 7, 1999, 64, 12, 3071, 1, 250, 8]
_EXPERT = re.compile(r"\.experts\.\d+\.")


def _split_bytes(path: str, model: torch.nn.Module, context: ParallelContext) -> tuple[int, int]:
    """Resident bytes of the split tensors (block scales included) on this rank, and their whole size in
    the checkpoint."""
    _, stored, plan = plan_shard(path, parallel=context)
    split = set(plan.slices) | {n for n in stored if _EXPERT.search(n)}
    held = model.official_state()
    return resident_bytes(held[n] for n in split if n in held), sum(stored[n].nbytes for n in split)


def _record_topk(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every indexer top-k the model computes from now on, in order (V4 indexers and V4.1 index sources)."""
    picked: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, Indexer):
            module.register_forward_hook(lambda _module, _args, out: picked.append(out))
        elif isinstance(module, Indexer41):
            module.select = lambda *args, select=module.select: picked.append(select(*args)) or picked[-1]
    return picked


def _results(rank: int, port: int, paths: dict[str, str]) -> dict:
    """``{case: (logits, embedding exact, (resident, whole) bytes, (top-k digest, count))}`` of one rank."""
    context, _, _ = init_group(rank, WORLD, Rendezvous(port=port), "cpu", 60.0)
    try:
        out = {}
        for case, path in paths.items():
            model = load_model(path, parallel=context)
            picked = _record_topk(model)
            with torch.no_grad():
                logits = model(torch.tensor(PROMPT))
                table = model.embed(torch.arange(model.cfg.vocab_size))
            exact = torch.equal(table, stored_tensors(path)["embed.weight"].read())
            topk = hashlib.sha256(b"".join(t.numpy().tobytes() for t in picked)).hexdigest(), len(picked)
            out[case] = (logits, exact, _split_bytes(path, model, context), topk)
        return out
    finally:
        dist.destroy_process_group()


def _worker(port: int, paths: dict[str, str], results: mp.Queue) -> None:
    torch.set_num_threads(1)  # as rank 0 (the package's conftest)
    out = _results(1, port, paths)
    results.put({arch: (logits.numpy(), *rest) for arch, (logits, *rest) in out.items()})


@pytest.fixture(scope="module")
def paths(fp8_tiny) -> dict[str, str]:
    return {**{arch: str(cached_tiny(arch)) for arch in ARCHS}, "v4-fp8": str(fp8_tiny)}


@pytest.fixture(scope="module")
def ranks(paths: dict[str, str]) -> dict[int, dict]:
    """Rank 0 here, rank 1 spawned: ``{rank: {case: (logits, embedding exact, (resident, whole) bytes)}}``."""
    mine, theirs = two_ranks(_worker, _results, paths)
    return {0: mine, 1: {case: (torch.from_numpy(logits), *rest) for case, (logits, *rest) in theirs.items()}}


def _reorder_reductions(model: torch.nn.Module) -> None:
    """Sum the two halves of every row-parallel product (``wo_b``, the shared experts' ``w2``) in the
    other order: what one process computes when only the reduction order changes."""

    def swapped(module, args, _out):
        (x,), w, half = args, module.weight, module.in_features // 2
        return F.linear(x[..., half:], w[:, half:]) + F.linear(x[..., :half], w[:, :half])

    for name, module in model.named_modules():
        if name.endswith(("attn.wo_b", "shared_experts.w2")):
            module.register_forward_hook(swapped)


@pytest.fixture(scope="module")
def noise() -> dict[str, float]:
    """Per architecture, how far reordering the reductions moves one process's logits."""
    out = {}
    with torch.no_grad():
        for arch in ARCHS:
            model, ids = load_model(cached_tiny(arch)), torch.tensor(PROMPT)
            single = model(ids)
            _reorder_reductions(model)
            out[arch] = (model(ids) - single).abs().max().item()
    return out


@pytest.mark.parametrize("case", CASES)
def test_tp2_logits_match_one_process_within_the_reduction_noise(
    ranks: dict, noise: dict, paths: dict, case: str
):
    """The FP8 case (packed, so not reordered by the hooks) is held to the bound of the dense V4."""
    with torch.no_grad():
        single = load_model(paths[case])(torch.tensor(PROMPT))
    bound = 4 * noise[case.removesuffix("-fp8")]
    tp0, tp1 = ranks[0][case][0], ranks[1][case][0]
    assert bound > 0, "the reordered run must differ, or it measures nothing"
    print(f"{case}: noise bound {bound:.3g}, TP=2 difference {(tp0 - single).abs().max():.3g}")
    assert torch.equal(tp0, tp1), "every rank gathers the same logits"
    assert (tp0 - single).abs().max().item() <= bound
    assert torch.equal(tp0.argmax(-1), single.argmax(-1))


@pytest.mark.parametrize("case", CASES)
def test_vocab_parallel_embedding_is_the_plain_lookup_bit_for_bit(ranks: dict, case: str):
    assert ranks[0][case][1] and ranks[1][case][1]


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_half_of_the_split_weights(ranks: dict, case: str):
    for rank in range(WORLD):
        resident, whole = ranks[rank][case][2]
        assert abs(resident / whole - 1 / WORLD) <= 0.02 / WORLD, (rank, resident, whole)


@pytest.mark.parametrize("case", CASES)
def test_every_rank_picks_the_same_indexer_top_k(ranks: dict, case: str):
    (digest, count), theirs = ranks[0][case][3], ranks[1][case][3]
    assert count > 0 and (digest, count) == theirs
