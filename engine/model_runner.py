"""Runs the model on the chunks of a step and returns the logits of the chunks that sample.

Each request keeps its model state (window keys, compressor state, compressed entries, Engram
history) between steps; a chunk starting at position 0 (a new or preempted request) starts over.
"""

from __future__ import annotations

import torch

from engine.scheduler import ScheduledChunk
from model.deepseek_v4 import DeepseekV4
from model.deepseek_v41 import DeepseekV41


class ModelRunner:
    def __init__(self, model: DeepseekV4 | DeepseekV41):
        self.model = model
        self.device = model.embed.weight.device
        self.states: dict[str, object] = {}

    @torch.no_grad()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits ``[n, V]`` of the last position of each chunk that samples, in order."""
        rows = []
        for chunk in chunks:
            request = chunk.request
            if chunk.start == 0:
                self.states[request.id] = self.model.new_state()
            state = self.states[request.id]
            ids = torch.tensor(request.tokens[chunk.start : chunk.start + chunk.length], device=self.device)
            logits = self.model(ids, state, last_only=True)
            if chunk.samples:
                rows.append(logits[0])
        vocab = self.model.cfg.vocab_size
        return torch.stack(rows) if rows else torch.zeros(0, vocab, device=self.device)

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
