"""The engine's configuration: what a launch line sets, free of torch so a command line can read it
(and bind its port) before anything heavy loads."""

from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_METHODS = ("mtp", "dspark")
# vLLM's speculative method names and ours: vLLM calls the V4 MTP layer `deepseek_mtp` or `mtp`.
SPECULATIVE_ALIASES = {"mtp": "mtp", "deepseek_mtp": "mtp", "dspark": "dspark"}


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 4096
    block_size: int = 16
    kv_cache_memory: int = 256 * 2**20  # bytes for the KV cache blocks
    seed: int = 0
    speculative_method: str | None = None  # "mtp" (V4 MTP layer) or "dspark" (DSpark stages)
    num_speculative_tokens: int | None = None  # drafts per step; default: 1 for mtp, the DSpark block
    dspark_min_confidence: float = 0.0  # verify the draft prefix whose confidence product stays above
    enable_prefix_caching: bool = True
    prefix_page_size: int = 256  # tokens per cached page: a multiple of every compress ratio, >= the window

    def __post_init__(self) -> None:
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(
                f"speculative_method={self.speculative_method!r} must be one of {SPECULATIVE_METHODS}"
            )
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")
