"""Prefix caching on a multi-turn chat workload: hit rate and time to first token, with and without.

``python -m benchmarks.prefix_cache [--arch v41] [--conversations 8] [--turns 6] [--tools 1]
[--system-rules 5] [--max-tokens 8]``

Each conversation is a system prompt with tools (the same for all) and a growing history: every turn
adds a user message, chat-encodes the whole conversation and generates a greedy reply, which joins the
history. The turns of all conversations run as one batch per turn, the same workload on two engines,
one with prefix caching and one without, side by side in one run (each turn on one, then on the
other, so that both see the same machine load). Printed per turn: the mean prompt length, the share
of prompt tokens found cached, and the mean time to first token of both engines and their ratio;
then the totals, and whether the replies are identical (they must be). The numbers are for this
machine only (the defaults keep the uncached run to some minutes on two CPU cores: the tiny models
prefill at tens of milliseconds per token there).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from model.chat import encode_messages
from model.chat_profile import RESERVED_FRAGMENTS, ChatProfile, select_chat_profile
from model.checkpoint import load_model, placement, placement_arguments
from model.testing.tiny import ARCHS, cached_tiny
from model.tokenizer import load_tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ')} for the user",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    }}
    for name in ("search_web", "read_calendar", "send_email", "convert_units")
]  # fmt: skip
QUESTIONS = ["How do I plan a trip to {c}?", "What should I pack for {c} in spring?",
             "Which museums in {c} open early?", "How do trains from {c} to the coast work?",
             "Can you draft an email to a hotel in {c}?", "Summarise our plan for {c}."]  # fmt: skip
CITIES = ["Lisbon", "Kyoto", "Quito", "Oslo", "Accra", "Hanoi", "Perth", "Tunis"]


@dataclass
class Turn:
    prompt_tokens: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # seconds from arrival to first token


def serve_turn(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[Turn, list[str]]:
    """One batch: every prompt added at once, stepped until done; TTFT of each and its reply text."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    requests = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    while engine.has_work:
        engine.step()
        now = time.perf_counter()
        first.update({r.id: now - start for r in requests if r.output and r.id not in first})
    turn = Turn(
        [len(p) for p in prompts], [r.num_cached or 0 for r in requests], [first[r.id] for r in requests]
    )
    return turn, [engine.completion(r).text for r in requests]


class Conversations:
    """One engine's conversations: a user message per turn, then its reply joins the history."""

    def __init__(self, engine: LLMEngine, profile: ChatProfile, system: str, args: argparse.Namespace):
        self.engine, self.profile, self.args = engine, profile, args
        self.histories = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
        self.turns: list[Turn] = []
        self.replies: list[str] = []
        serve_turn(engine, [list(range(3, 19))], 1)  # warm up: the first step of a process is slow

    def turn(self, k: int) -> None:
        for i, history in enumerate(self.histories):
            history.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)].format(c=CITIES[i % 8])})
        texts = [
            encode_messages(h, profile=self.profile, tools=TOOLS[: self.args.tools]) for h in self.histories
        ]
        prompts = [self.engine.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
        turn, replies = serve_turn(self.engine, prompts, self.args.max_tokens)
        for history, text in zip(self.histories, replies, strict=True):
            for fragment in RESERVED_FRAGMENTS:  # the random model's replies may spell the encoding's markers
                text = text.replace(fragment, "")
            history.append({"role": "assistant", "content": text})
        self.turns.append(turn)
        self.replies += replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="v41", choices=ARCHS)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tools", type=int, default=1, choices=range(len(TOOLS) + 1))
    parser.add_argument("--system-rules", type=int, default=5, help="sentences of the system prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    placement_arguments(parser)
    args = parser.parse_args()
    path: Path = cached_tiny(args.arch)
    device, dtype = placement(args.device, args.dtype)
    model, tokenizer = load_model(path, dtype, device), load_tokenizer(path)
    profile = select_chat_profile(model.cfg.model_type, path, None)
    system = " ".join(
        f"Rule {i}: be brief, cite sources, ask before acting." for i in range(args.system_rules)
    )
    chats = []
    for caching in (True, False):
        config = EngineConfig(max_num_batched_tokens=2048, max_model_len=16384, kv_cache_memory=2**30,
                              enable_prefix_caching=caching)  # fmt: skip
        chats.append(Conversations(LLMEngine(model, tokenizer, config), profile, system, args))
    for k in range(args.turns):  # turn by turn on both engines, so that both see the same machine load
        for chat in chats:
            chat.turn(k)
    (warm, warm_replies), (cold, cold_replies) = ((c.turns, c.replies) for c in chats)
    print(f"tiny {args.arch}, {args.conversations} conversations x {args.turns} turns, "
          f"{args.max_tokens} new tokens per reply, greedy:")  # fmt: skip
    print("  turn  prompt tokens  cached  TTFT cached  TTFT uncached  ratio")
    for k, (on, off) in enumerate(zip(warm, cold, strict=True)):
        hit = sum(on.cached) / sum(on.prompt_tokens)
        a, b = statistics.mean(on.ttft), statistics.mean(off.ttft)
        length = statistics.mean(on.prompt_tokens)
        print(f"  {k + 1:4d}  {length:13.0f}  {hit:6.1%}  {a:9.2f} s  {b:11.2f} s  {b / a:5.2f}")
    queried = sum(sum(t.prompt_tokens) for t in warm)
    cached = sum(sum(t.cached) for t in warm)
    a = statistics.mean(x for t in warm for x in t.ttft)
    b = statistics.mean(x for t in cold for x in t.ttft)
    print(f"  all   hit rate {cached / queried:.1%} of {queried} prompt tokens; "
          f"mean TTFT {a:.2f} s cached vs {b:.2f} s uncached: ratio {b / a:.2f}")  # fmt: skip
    same = sum(x == y for x, y in zip(warm_replies, cold_replies, strict=True))
    print(
        f"  replies {'identical' if same == len(warm_replies) else 'DIFFER'}: {same} of {len(warm_replies)}"
    )


if __name__ == "__main__":
    main()
