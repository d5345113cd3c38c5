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
    tensor_parallel_size: int = 1  # ranks the model is split over (one process each)

    def __post_init__(self) -> None:
        counts = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "prefix_page_size",
                  "tensor_parallel_size")  # fmt: skip
        for name in counts:
            if (value := getattr(self, name)) < 1:
                raise ValueError(f"{name}={value} must be at least 1")
        if self.kv_cache_memory < 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory} must be at least 0 bytes")
        if not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed={self.seed} must be in [-2**63, 2**64)")
        if not 0.0 <= self.dspark_min_confidence < 1.0:
            raise ValueError(f"dspark_min_confidence={self.dspark_min_confidence} must be in [0, 1)")
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(
                f"speculative_method={self.speculative_method!r} must be one of {SPECULATIVE_METHODS}"
            )
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")
        if self.tensor_parallel_size > 1 and (self.speculative_method or self.enable_prefix_caching):
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} runs without speculative decoding and "
                "prefix caching for now: set speculative_method=None and enable_prefix_caching=False"
            )
