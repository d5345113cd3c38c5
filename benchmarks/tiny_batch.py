"""What the engine benchmarks on a tiny checkpoint start from: its model where ``--device`` and ``--dtype``
put it, its tokenizer, and ``--requests`` random prompts of ``--prompt-len`` tokens."""

from __future__ import annotations

import argparse

import torch
from tokenizers import Tokenizer

from model.causal_lm import CausalLM
from model.checkpoint import load_model, placement
from model.testing.tiny import cached_tiny
from model.tokenizer import load_tokenizer


def tiny_batch(arch: str, args: argparse.Namespace) -> tuple[CausalLM, Tokenizer, list[list[int]]]:
    path = cached_tiny(arch)
    device, dtype = placement(args.device, args.dtype)
    model = load_model(path, dtype, device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.requests)]  # fmt: skip
    return model, load_tokenizer(path), prompts
