"""DeepSeek V4.1 on the tiny checkpoint: incremental == cache-free, two-level TopK, sources, DSpark."""

from __future__ import annotations

import json

import pytest
import torch

from model.attention_v41 import Indexer41, V41Attention
from model.block import one_hot_premix
from model.checkpoint import SINGLE_FILE, load_model, read_tensors
from model.config import ModelConfig
from model.engram import Fp8Table
from model.plan import Attention, Candidates
from model.quant_linear import Fp8Linear
from model.testing.tiny import write_tiny
from triton_kernels import tuning

pytestmark = pytest.mark.long  # among the longest test files: scheduled first (tests/conftest.py)

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny-v41"), arch="v41")


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir)


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 4096, (length,), generator=torch.Generator().manual_seed(seed))


def with_config(src, dst, **changes):
    """A copy of checkpoint ``src`` whose text config has ``changes``."""
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    raw["text_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    for name in (SINGLE_FILE, "tokenizer.json"):
        (dst / name).symlink_to(src / name)
    return dst


def chunked(model, ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    state, outs, start = model.new_state(), [], 0
    while start < ids.shape[0]:
        size = sizes[min(len(outs), len(sizes) - 1)]
        outs.append(model(ids[start : start + size], state))
        start += size
    assert state.num_tokens == ids.shape[0]
    return torch.cat(outs)


def test_plan_of_the_toy(model):
    kinds = [p.attention for p in model.plan if not p.is_draft]
    assert kinds == [Attention.SLIDING] * 2 + [Attention.FULL, Attention.REUSE] * 2 + [
        Attention.FULL, Attention.REUSE, Attention.REINDEX, Attention.REUSE,
    ]  # fmt: skip
    assert [model.plan[i].candidates for i in (6, 7, 8)] == [
        Candidates.SOURCE,
        Candidates.NONE,
        Candidates.CONSUMER,
    ]
    assert [model.plan[i].kv_source for i in (3, 5, 7, 9)] == [2, 4, 6, 6]
    assert model.plan[9].index_source == 8
    assert not any(n.startswith("hc_head") for n in model.checkpoint_names())


@pytest.mark.parametrize("length", [1, 9, 200, 600])
def test_incremental_and_chunked_equal_cache_free(model, length):
    ids = prompt(length, seed=length)
    with torch.no_grad():
        full = model(ids)
        prefill = max(1, length - 24)  # prefill, then decode the rest token by token
        state = model.new_state()
        incremental = torch.cat(
            [model(ids[:prefill], state)] + [model(ids[t : t + 1], state) for t in range(prefill, length)]
        )
        diffs = {"incremental": (incremental - full).abs().max().item()}
        for size in (1, 5, 64):
            diffs[f"chunks of {size}"] = (chunked(model, ids, [size]) - full).abs().max().item()
    print(f"length {length}: max |logits - cache-free| {diffs}")
    assert max(diffs.values()) <= TOL


def test_two_level_with_every_block_kept_equals_one_level(tiny_dir, tmp_path):
    one_level = load_model(with_config(tiny_dir, tmp_path / "one", candidate_source_layer_id=-1))
    every_block = load_model(with_config(tiny_dir, tmp_path / "all", candidate_topk_blocks=2048))
    ids = prompt(300, seed=7)
    with torch.no_grad():
        assert torch.equal(one_level(ids), every_block(ids))


def test_two_level_selection_invariants(model, monkeypatch):
    record = []
    select = Indexer41.select

    def spy(self, queries, batch, published):
        picked = select(self, queries, batch, published)
        record.append((self.plan, queries.visible.long(), published.candidates, picked.long()))
        return picked

    monkeypatch.setattr(Indexer41, "select", spy)
    with torch.no_grad():
        model(prompt(400, seed=3))
    cfg = model.cfg
    block = cfg.candidate_block_size
    _, visible, blocks, own = next(r for r in record if r[0].candidates is Candidates.SOURCE)
    picked = next(r for r in record if r[0].candidates is Candidates.CONSUMER)[3]
    assert blocks.shape == (400, cfg.candidate_topk_blocks)
    newest = (visible - 1) // block
    assert (blocks == newest[:, None]).any(dim=1).all()  # the newest block is always a candidate
    kept = blocks >= 0
    assert (blocks[kept] < (visible[:, None].expand_as(blocks)[kept] + block - 1) // block).all()
    valid = picked >= 0
    inside = (blocks[:, None, :] == (picked // block)[:, :, None]).any(dim=2)
    assert inside[valid].all()  # consumers pick only inside the candidate blocks
    assert (picked[valid] < visible[:, None].expand_as(picked)[valid]).all()
    own_inside = (blocks[:, None, :] == (own // block)[:, :, None]).any(dim=2)
    assert not own_inside[own >= 0].all()  # the source's own selection is unrestricted


def test_reuse_reads_its_source_and_reindex_rescoring(model, monkeypatch):
    ids = prompt(120, seed=5)
    outputs = {}
    hooks = [
        layer.attn.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out.clone()))
        for i, layer in enumerate(model.layers)
    ]
    topk = {}
    forward = V41Attention.forward

    def perturbing(self, x, batch, inv_freq, published):
        out = forward(self, x, batch, inv_freq, published)
        if self.plan.index == 4 and perturb:
            batch.pools.entries[4].data.add_(0.5)  # what the source published, after it used it
        topk.update(published.topk)
        return out

    monkeypatch.setattr(V41Attention, "forward", perturbing)
    with torch.no_grad():
        perturb = False
        model(ids)
        clean = dict(outputs)
        perturb = True
        model(ids)
    for h in hooks:
        h.remove()
    assert not torch.allclose(outputs[5], clean[5])  # Reuse 5 reads source 4's KV
    assert torch.equal(outputs[3], clean[3])  # Reuse 3 reads source 2: untouched
    assert not torch.equal(topk[8], topk[6])  # Reindex 8 re-scores with its own queries
    assert topk[8].shape == topk[6].shape


def test_layer0_attention_input_is_the_normed_embedding(model):
    ids = prompt(16)
    seen = []
    hook = model.layers[0].attn.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    assert torch.allclose(seen[0], model.layers[0].attn_norm(model.embed(ids)), atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engram_num_embeddings": [6126, 6333]}, "engram_num_embeddings"),
        ({"kv_source_layer_ids": [2, 4, 6, 9]}, "kv_source_layer_ids"),
        ({"index_source_layer_ids": [2, 6, 8]}, "kv_source_layer_ids"),
        ({"candidate_topk_blocks": 2}, "index_topk"),
        ({"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 1]}, "ratio"),
        ({"candidate_source_layer_id": 8}, "candidate_source_layer_id"),
        ({"dspark_target_layer_ids": [7, 12]}, "dspark_target_layer_ids"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 1]}, r"compress_ratios\[11\]=1"),
        ({"num_hash_layers": 2}, "num_hash_layers"),
        ({"candidate_block_size": 3}, "candidate block_size"),
        ({"candidate_topk_blocks": 4096}, "topk_blocks"),
        ({"index_topk": 4096}, "top-k kernel limit"),
    ],
)
def test_bad_v41_config_fails_at_start(tiny_dir, change, message):
    raw = json.loads((tiny_dir / "config.json").read_text())
    raw["text_config"].update(change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_bad_v41_checkpoint_fails_at_start(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_dir / SINGLE_FILE)
    del tensors["layers.4.engram.wkv.weight"]
    tensors["mtp.2.markov_head.extra"] = torch.zeros(1)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, bad / SINGLE_FILE)
    for name in ("config.json", "tokenizer.json"):
        (bad / name).symlink_to(tiny_dir / name)
    with pytest.raises(
        ValueError, match="missing: layers.4.engram.wkv.weight.*unexpected: mtp.2.markov_head.extra"
    ):
        load_model(bad)


def test_dspark_block_is_non_causal_with_a_bounded_context(model):
    cfg, stage = model.cfg, model.mtp[0]
    block, device = cfg.dspark.block_size, torch.device("cpu")
    ids = torch.full((block,), cfg.dspark.noise_token_id)
    ids[0] = 7
    positions = torch.arange(40, 40 + block)
    context = torch.randn(cfg.sliding_window, cfg.head_dim, generator=torch.Generator().manual_seed(0))

    def run(ids, context):
        x = model.embed(ids)[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
        every = torch.arange(context.shape[0] + block).expand(block, -1)
        carry = one_hot_premix(block, cfg.hc_mult, device)
        return stage(x, carry, ids, context, every, positions, model.rope.main)[0]

    with torch.no_grad():
        base = run(ids, context)
        later = ids.clone()
        later[-1] = 11
        assert not torch.allclose(run(later, context)[0], base[0])  # a later token changes the first output
        state = model.mtp.new_state(device)
        out = model.run(prompt(50), None)
        model.mtp.add_context(out.target_features, state, model.rope.main)
        assert all(k.shape[0] == cfg.sliding_window for k in state.keys) and state.num_tokens == 50
        [draft] = model.mtp.propose([5], [state], model.embed, model.head, model.rope.main)
    assert len(draft.tokens) == block and draft.logits.shape == (block, cfg.vocab_size)
    assert ((draft.confidence > 0) & (draft.confidence < 1)).all()
    assert draft.tokens == draft.logits.argmax(-1).tolist()


def test_quantised_v41_checkpoint_loads_packed(tiny_dir, model, tmp_path):
    """FP8 linears (Engram's ``wkv`` too), FP8 Engram tables (per-row scales) and MXFP4 experts stay as
    stored, and compute what their dequantised forms compute."""
    fp8 = write_tiny(tmp_path / "fp8", arch="v41", fp8=True)
    packed, dense = load_model(fp8), load_model(fp8, quantization="dense")
    engram = packed.layers[1].engram
    assert isinstance(engram.embed, Fp8Table) and engram.embed.weight.dtype == torch.float8_e4m3fn
    assert isinstance(engram.wkv, Fp8Linear)
    stored = sum(t.nbytes for t in read_tensors(fp8).values())
    assert sum(t.nbytes for t in packed.official_state().values()) == stored  # nothing expanded
    table, ref = dense.layers[1].engram.embed.weight, model.layers[1].engram.embed.weight
    assert ((table - ref).abs() <= ref.abs() / 16 + 2.0**-12).all()
    ids = torch.randint(0, table.shape[0], (7, 3))
    assert torch.equal(engram.embed.lookup(ids, torch.device("cpu")), table[ids])
    with torch.no_grad():
        ours, theirs = packed(prompt(40)), dense(prompt(40))
    assert torch.isfinite(ours).all()
    assert (ours - theirs).abs().max() <= 1e-4 and torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_dspark_drafts_a_batch_as_it_drafts_each_request(model):
    """One pass over several requests' blocks (contexts of different lengths) equals one pass each."""
    states, anchors = [], [5, 9, 13]
    with torch.no_grad():
        for length in (3, 40, 17):
            state = model.mtp.new_state(torch.device("cpu"))
            model.mtp.add_context(
                model.run(prompt(length, seed=length)).target_features, state, model.rope.main
            )
            states.append(state)
        together = model.mtp.propose(anchors, states, model.embed, model.head, model.rope.main)
        for anchor, state, draft in zip(anchors, states, together, strict=True):
            [alone] = model.mtp.propose([anchor], [state], model.embed, model.head, model.rope.main)
            assert draft.tokens == alone.tokens
            torch.testing.assert_close(draft.logits, alone.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(draft.confidence, alone.confidence, rtol=1e-5, atol=1e-6)


def test_every_op_on_its_triton_kernel_equals_the_references(model, monkeypatch):
    """V4.1 with every op on its Triton kernel (interpreted): prefill, a split-decode step and a chunk
    over the cached state give the logits of the torch references."""
    ids = prompt(16, seed=3)
    with torch.no_grad():
        expected = chunked(model, ids, [12, 1, 3])
        monkeypatch.setenv("DSV4_TRITON_ON_CPU", "1")
        with tuning.recording() as launches:
            got = chunked(model, ids, [12, 1, 3])
    ops = {launch.kernel.op for launch in launches}
    assert ops >= {"compressor", "engram", "indexer", "mhc", "rmsnorm", "rope", "sparse_attn"}, ops
    assert (got - expected).abs().max().item() <= TOL
