"""Acceptance counters of speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    verify_steps: int = 0  # request-steps that verified at least one draft
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        grow = max(0, drafted - len(self.drafted_at))
        self.drafted_at += [0] * grow
        self.accepted_at += [0] * grow
        for k in range(drafted):
            self.drafted_at[k] += 1
            self.accepted_at[k] += k < accepted
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted

    @property
    def acceptance_rate(self) -> list[float]:
        """Per draft position: accepted / drafted."""
        return [a / d for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request-step emits on average: its accepted drafts plus the target's token."""
        return 1 + self.accepted / self.verify_steps if self.verify_steps else 0.0
