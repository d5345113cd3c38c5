"""The shapes that kernel benchmarks and sweeps run: a model config and the serving limits.

Decode runs ``max_num_seqs`` requests one token each at the end of ``max_model_len`` positions (a
sweep also runs every power of two below it, so that smaller decode batches, whose buckets differ
where a kernel's key holds the token count, get a config of their own); prefill runs one
``max_num_batched_tokens`` chunk at the end of a ``max_model_len`` prompt. Every other dimension
(heads, head dims, top-k, ratios, candidate blocks, Engram) comes from the model config. Under the
interpreter the phases are tiny, whatever the limits.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from model.config import ModelConfig
from model.testing.tiny import toy_config


@dataclass(frozen=True)
class Phase:
    label: str  # "decode" or "prefill"
    requests: int
    tokens: int  # new tokens per request
    context: int  # positions of each request once its new tokens are in

    @property
    def total(self) -> int:
        return self.requests * self.tokens

    def __str__(self) -> str:
        return f"{self.label} {self.requests}x{self.tokens} ctx {self.context}"


# With two to four interpreted cores (the CPU profile), one decode token takes the split attention path
# and four prefill tokens the one-pass path: both kernels run.
TINY_PHASES = (Phase("decode", 1, 1, 64), Phase("prefill", 1, 4, 64))


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 32768

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"{name}: {value} must be >= 1")
        if self.max_num_batched_tokens > self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens: {self.max_num_batched_tokens} exceeds max_model_len"
                f" {self.max_model_len}"
            )

    def phases(self, every_batch: bool) -> tuple[Phase, ...]:
        top = self.max_num_seqs
        batches = [2**i for i in range(top.bit_length()) if 2**i < top] if every_batch else []
        decode = tuple(Phase("decode", b, 1, self.max_model_len) for b in (*batches, top))
        return (*decode, Phase("prefill", 1, self.max_num_batched_tokens, self.max_model_len))


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    source: str  # where the model config came from
    phases: tuple[Phase, ...]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-config", metavar="DIR", help="checkpoint folder (or config.json); default: the tiny V4.1"
    )
    defaults = Limits()
    for name in vars(defaults):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(defaults, name), help="serving limit")


def from_arguments(args: argparse.Namespace, tiny: bool, every_batch: bool) -> Workload:
    if args.model_config:
        model, source = ModelConfig.from_file(args.model_config), str(Path(args.model_config))
    else:
        model, source = ModelConfig.from_dict(toy_config("v41")), "tiny v41 (model.testing.tiny)"
    limits = Limits(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len)
    return Workload(model, source, TINY_PHASES if tiny else limits.phases(every_batch))
