"""Records the Triton launches of the tiny V4 and V4.1 models into launches.json, for the Ascend gate.

The gate lowers every (kernel, signature, constexprs) recorded here, so the constexpr values and dtypes
the models really launch are compiled for Ascend, not only the representative ones of ``KERNELS``. Run it
in the main venv (upstream triton, interpreter) after a change to a launcher or to the models; the
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

from model.checkpoint import load_model  # noqa: E402
from model.tiny import ARCHS, write_tiny  # noqa: E402
from tests.triton_kernels.bounds import PACKAGE, BoundsCheck, marked_lines  # noqa: E402
from triton_kernels import tuning  # noqa: E402

OUT = Path(__file__).resolve().with_name("launches.json")
# A prefill chunk, a decode step (split + merge attention), then a short chunk over the cached state.
CHUNKS = (12, 1, 3)


def record(arch: str) -> list[tuning.Launch]:
    """The model's launches; every lane of the accesses marked in bounds is checked on the way."""
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(write_tiny(Path(tmp), arch))
    ids = torch.randint(3, model.cfg.vocab_size, (sum(CHUNKS),), generator=torch.Generator().manual_seed(0))
    state, start = model.new_state(), 0
    check = BoundsCheck(marked_lines(sorted(PACKAGE.glob("*.py"))))
    with torch.no_grad(), tuning.recording() as launches, pytest.MonkeyPatch.context() as patch:
        check.install(patch)
        for size in CHUNKS:
            model(ids[start : start + size], state)
            start += size
    print(f"{arch}: {len(launches)} launches, {sum(check.hits.values())} checked marked accesses in bounds")
    return launches


def main() -> int:
    entries: dict[str, dict] = {}
    for arch in ARCHS:
        for launch in record(arch):
            entry = {
                "op": launch.kernel.op,
                "kernel": launch.kernel.kernel.fn.__name__,
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
    print(f"{len(unique)} distinct launches of {', '.join(ARCHS)} written to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
