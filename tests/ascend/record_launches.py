"""Records the Triton launches of the tiny V4 and V4.1 models, and of V4-Flash and V4.1-Flash, into
launches.json, for the Ascend gate.

The gate lowers every (kernel, signature, constexprs) recorded here, so the constexpr values and dtypes
the models really launch are compiled for Ascend, not only the representative ones of ``KERNELS``.
The tiny models run from their checkpoints in fp32, and from their official FP8 / MXFP4 form (kept
packed) in bf16, the device default. The releases run in bf16 at their own widths (model-spec §2:
heads, head and rope dims, ranks, Engram heads: all that shapes a constexpr) with the toy's depth,
vocabulary and a pair of routed experts, and random dense weights, so that they fit a CPU. Each model runs
over a cache in the compute dtype and over an int8 one (model-spec §9.4: the quantised cache write, int8
sparse attention and indexer operands; Ascend has no FP8, so no fp8 cache is recorded). Their packed
GEMMs launch the tiles of the tiny FP8 models (the widths do not choose them) with V4's 128-wide scale
blocks, which the toys cannot take (a 32-row output group): that variant is lowered as declared. Run
it in the main venv (upstream triton, interpreter) after a change to a launcher or to the models; the
accesses marked in bounds are checked for every lane meanwhile (tests/triton_kernels/bounds.py):

    python tests/ascend/record_launches.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton_kernels is imported: kernels run on CPU tensors
os.environ["DSV4_TRITON_ON_CPU"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from model.checkpoint import build_model, load_model, parameter_dtype  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.config.sections import bucket_layout  # noqa: E402
from model.testing.release_like import V4_FLASH_WIDTHS, V41_FLASH_WIDTHS  # noqa: E402
from model.testing.tiny import ARCHS, toy_config, write_tiny  # noqa: E402
from model.tokenizer import TOKENIZER_PATH  # noqa: E402
from tests.triton_kernels.bounds import PACKAGE, BoundsCheck, marked_lines  # noqa: E402
from triton_kernels import tuning  # noqa: E402

OUT = Path(__file__).resolve().with_name("launches.json")
# A prefill chunk, a decode step (split + merge attention), then a short chunk over the cached state.
CHUNKS = (12, 1, 3)
KV_CACHE_DTYPES = ("auto", "int8")  # what Ascend runs


_FEW_EXPERTS = {"n_routed_experts": 2, "num_experts_per_tok": 2}
RELEASES = {"v4-flash": ("v4", V4_FLASH_WIDTHS), "v41-flash": ("v41", V41_FLASH_WIDTHS)}
MODELS = (*ARCHS, *(f"{arch}-fp8" for arch in ARCHS), *RELEASES)


def release_model(name: str) -> torch.nn.Module:
    """The release ``name`` at its widths in bf16 with random weights (see the module docstring)."""
    arch, widths = RELEASES[name]
    raw = toy_config(arch)
    text = raw.get("text_config", raw)
    text.update(widths, **_FEW_EXPERTS)
    if "dspark_n_routed_experts" in text:
        text.update(dspark_n_routed_experts=2, dspark_num_experts_per_tok=2)
    if "engram_layer_ids" in text:  # the table rows follow from the heads: the primes of each head
        orders = (len(text["engram_layer_ids"]), text["engram_max_ngram_size"], text["engram_n_heads"])
        text["engram_num_embeddings"] = list(bucket_layout(*orders, text["engram_vocab_size"]).rows)
    model = build_model(ModelConfig.from_dict(raw), TOKENIZER_PATH)
    for param_name, param in model.named_parameters():
        param.data = param.data.to(parameter_dtype(param_name, torch.bfloat16))
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5 + (t.dim() == 1))
            else:  # tid2eid: expert ids
                t.copy_(torch.randint(0, 2, t.shape, generator=gen))
    model.init_buffers()
    return model.requires_grad_(False).eval()


def record(name: str) -> list[tuning.Launch]:
    """The model's launches; every lane of the accesses marked in bounds is checked on the way."""
    if name in RELEASES:
        model = release_model(name)
    else:  # "<arch>-fp8": the official storage, kept packed, computing in bf16 as on a device
        arch, fp8 = name.removesuffix("-fp8"), name.endswith("-fp8")
        with tempfile.TemporaryDirectory() as tmp:
            model = load_model(write_tiny(Path(tmp), arch, fp8=fp8), torch.bfloat16 if fp8 else torch.float32)
    ids = torch.randint(3, model.cfg.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(0))
    check = BoundsCheck(marked_lines(sorted(PACKAGE.glob("*.py"))))
    with torch.no_grad(), tuning.recording() as launches, pytest.MonkeyPatch.context() as patch:
        check.install(patch)
        for kv_cache_dtype in KV_CACHE_DTYPES:
            state, start = model.new_state(kv_cache_dtype), 0
            for size in CHUNKS:
                model(ids[start : start + size], state)
                start += size
    print(f"{name}: {len(launches)} launches, {sum(check.hits.values())} checked marked accesses in bounds")
    return launches


def main() -> int:
    entries: dict[str, dict] = {}
    for arch in MODELS:
        for launch in record(arch):
            entry = {
                "op": launch.kernel.op,
                "kernel": launch.kernel.name,
                "signature": launch.signature,
                "constexprs": launch.constexprs,
            }
            entries.setdefault(json.dumps(entry, sort_keys=True), {**entry, "models": []})["models"].append(
                arch
            )
    unique = sorted(entries.values(), key=lambda e: (e["op"], e["kernel"], json.dumps(e["constexprs"])))
    for entry in unique:
        entry["models"] = sorted(set(entry["models"]))
    OUT.write_text(json.dumps({"launches": unique}, indent=1) + "\n")
    print(f"{len(unique)} distinct launches of {', '.join(MODELS)} written to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
