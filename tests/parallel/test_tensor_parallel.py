"""The model split over 2 CPU ranks (gloo) against the model in one process, on the tiny V4 and V4.1:
logits within the noise of a reordered reduction, the vocabulary-parallel embedding exact, and each
rank holding half of the split tensors' bytes."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from engine.workers import free_port, init_group
from model.checkpoint import build_model, load_model, stored_tensors
from model.config import ModelConfig
from model.parallel import ParallelContext, shard_model
from model.tiny import cached_tiny

WORLD = 2
ARCHS = ("v4", "v41")
PROMPT = [0, 17, 4000, 5, 5, 93, 2048, 311, 7, 1999, 64, 12, 3071, 1, 250, 8]
_EXPERT = re.compile(r"\.experts\.\d+\.")


def _split_bytes(path, model: torch.nn.Module, context: ParallelContext) -> tuple[int, int]:
    """Resident bytes of the split tensors on this rank, and their whole size in the checkpoint."""
    meta = build_model(ModelConfig.from_file(path), path)
    plan = shard_model(meta, context)
    stored = stored_tensors(path)
    split = set(plan.slices) | {n for n in stored if _EXPERT.search(n)}
    held = model.official_state()
    resident = sum(held[n].untyped_storage().nbytes() for n in split if n in held)
    return resident, sum(stored[n].nbytes for n in split)


def _results(rank: int, port: int) -> dict:
    """``{arch: (logits, embedding exact, (resident, whole) bytes)}`` of one rank."""
    context, _ = init_group(rank, WORLD, port, "cpu", 60.0)
    try:
        out = {}
        for arch in ARCHS:
            path = cached_tiny(arch)
            model = load_model(path, parallel=context)
            with torch.no_grad():
                logits = model(torch.tensor(PROMPT))
                table = model.embed(torch.arange(model.cfg.vocab_size))
            exact = torch.equal(table, stored_tensors(path)["embed.weight"].read())
            out[arch] = (logits, exact, _split_bytes(path, model, context))
        return out
    finally:
        dist.destroy_process_group()


def _worker(port: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)  # as rank 0 (the package's conftest)
    out = _results(1, port)
    results.put({arch: (logits.numpy(), *rest) for arch, (logits, *rest) in out.items()})


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict]:
    """Rank 0 here, rank 1 spawned: ``{rank: {arch: (logits, embedding exact, (resident, whole) bytes)}}``."""
    spawn = mp.get_context("spawn")
    results, port = spawn.Queue(), free_port()
    worker = spawn.Process(target=_worker, args=(port, results), daemon=True)
    worker.start()
    try:
        mine = _results(0, port)
        theirs = {
            arch: (torch.from_numpy(logits), *rest)
            for arch, (logits, *rest) in results.get(timeout=60).items()
        }
        return {0: mine, 1: theirs}
    finally:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.terminate()


def _reorder_reductions(model: torch.nn.Module) -> None:
    """Sum the two halves of every row-parallel product (``wo_b``, the shared experts' ``w2``) in the
    other order: what one process computes when only the reduction order changes."""

    def swapped(module, args, _out):
        (x,), w, half = args, module.weight, module.in_features // 2
        return F.linear(x[..., half:], w[:, half:]) + F.linear(x[..., :half], w[:, :half])

    for name, module in model.named_modules():
        if name.endswith(("attn.wo_b", "shared_experts.w2")):
            module.register_forward_hook(swapped)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_logits_match_one_process_within_the_reduction_noise(ranks: dict, arch: str):
    path, ids = cached_tiny(arch), torch.tensor(PROMPT)
    with torch.no_grad():
        model = load_model(path)
        single = model(ids)
        _reorder_reductions(model)
        noise = (model(ids) - single).abs().max().item()
    tp0, tp1 = ranks[0][arch][0], ranks[1][arch][0]
    assert noise > 0, "the reordered run must differ, or it measures nothing"
    print(f"{arch}: reordered-reduction noise {noise:.3g}, TP=2 difference {(tp0 - single).abs().max():.3g}")
    assert torch.equal(tp0, tp1), "every rank gathers the same logits"
    assert (tp0 - single).abs().max().item() <= 4 * noise
    assert torch.equal(tp0.argmax(-1), single.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_vocab_parallel_embedding_is_the_plain_lookup_bit_for_bit(ranks: dict, arch: str):
    assert ranks[0][arch][1] and ranks[1][arch][1]


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_holds_half_of_the_split_weights(ranks: dict, arch: str):
    for rank in range(WORLD):
        resident, whole = ranks[rank][arch][2]
        assert abs(resident / whole - 1 / WORLD) <= 0.02 / WORLD, (rank, resident, whole)
