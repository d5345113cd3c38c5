"""Greedy continuation of a prompt: ``python -m model.generate [--model DIR] --prompt TEXT``.

Without ``--model`` a tiny random checkpoint is written (once, in the user cache) and used, so the output is
well-formed gibberish: the point is the whole path from tokenizer to logits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from model.causal_lm import CausalLM
from model.chat import encode_messages
from model.chat_profile import PROFILES, select_chat_profile
from model.checkpoint import load_model, loader_quantization, placement, placement_arguments
from model.testing.tiny import ARCHS, cached_tiny
from model.tokenizer import load_tokenizer, prompt_ids


@torch.no_grad()
def greedy(model: CausalLM, prompt: list[int], max_new_tokens: int, use_cache: bool = True) -> list[int]:
    """Greedy tokens after ``prompt``; stops early at EOS.

    ``use_cache=False`` recomputes the whole sequence every step (the cache-free path).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be non-negative")
    state = model.new_state() if use_cache else None
    tokens, out = list(prompt), []
    device = model.embed.weight.device
    step = torch.tensor(tokens, device=device)
    for _ in range(max_new_tokens):
        logits = model(step, state) if use_cache else model(torch.tensor(tokens, device=device))
        token = int(logits[-1].argmax())
        out.append(token)
        tokens.append(token)
        if token == model.cfg.eos_token_id:
            break
        step = torch.tensor([token], device=device)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: a tiny random checkpoint of --arch)")
    parser.add_argument("--arch", default="v4", choices=ARCHS)
    parser.add_argument("--prompt", default="The quick brown fox")
    parser.add_argument("--max-tokens", type=int, default=32)
    placement_arguments(parser)
    parser.add_argument("--quantization", choices=["fp8", "ascend", "w8a8"],
                        help="the stored format, or w8a8: requantise an fp8 checkpoint at load")  # fmt: skip
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message, chat-encoded")
    parser.add_argument("--chat-encoding", choices=PROFILES, help="with --chat: override the checkpoint's")
    args = parser.parse_args(argv)
    path = Path(args.model) if args.model else cached_tiny(args.arch)
    try:
        device, dtype = placement(args.device, args.dtype)
        quantization = loader_quantization(path, args.quantization)
    except ValueError as err:
        parser.error(str(err))
    model = load_model(path, dtype, device, quantization)
    tokenizer = load_tokenizer(path / "tokenizer.json")
    if args.chat:
        profile = select_chat_profile(model.cfg.model_type, path, args.chat_encoding)
        print(f"chat encoding: {profile.name}")
        text = encode_messages([{"role": "user", "content": args.prompt}], profile=profile)  # BOS included
        prompt = tokenizer.encode(text, add_special_tokens=False).ids
    else:
        prompt = prompt_ids(tokenizer, args.prompt, model.cfg.bos_token_id)
    completion = greedy(model, prompt, args.max_tokens)
    print(args.prompt + tokenizer.decode(completion))


if __name__ == "__main__":
    main()
