"""The engine's configuration: what a launch line sets, free of torch so a command line can read it
(and bind its port) before anything heavy loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SPECULATIVE_METHODS = ("mtp", "dspark")
# How the KV cache stores its rows (model.cache.KV_CACHE_DTYPES, repeated here to keep this module free of
# torch; a test checks they agree).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# vLLM's speculative method names and ours: vLLM calls the V4 MTP layer `deepseek_mtp` or `mtp`.
SPECULATIVE_ALIASES = {"mtp": "mtp", "deepseek_mtp": "mtp", "dspark": "dspark"}


def read_speculative_config(config: Any, name: str) -> tuple[str, int | None]:
    """vLLM's ``speculative_config`` (``{"method": ..., "num_speculative_tokens": ...}``) as our method and
    draft count; ``name``: how an error names it (the server's flag, ``LLM``'s argument)."""
    if not isinstance(config, dict):
        raise ValueError(f"{name} must be a JSON object, not {config!r}")
    if unknown := sorted(set(config) - {"method", "num_speculative_tokens"}):
        raise ValueError(f"{name}: {', '.join(unknown)} not supported (method, num_speculative_tokens)")
    method = SPECULATIVE_ALIASES.get(config.get("method"))
    if method is None:
        raise ValueError(f"{name} method={config.get('method')!r}: one of {sorted(SPECULATIVE_ALIASES)}")
    return method, config.get("num_speculative_tokens")


def _flag(default: Any, help: str, **cli: Any) -> Any:
    """An engine field and its server flag ``--field-name``: the help, and how the flag reads its value
    (``unit``: ``tokens`` as 64k / ``bytes`` as 8GiB / ``tokens or auto``, vLLM's `auto` read as None,
    settled at start-up; ``choices``; ``unset``: the flag defaults to None,
    meaning the field's default, so another flag can stand in for it; ``cli=False``: declared by hand with
    its siblings, as ``--tensor-parallel-size`` is beside vLLM's other parallel flags)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is built with; the server's flags are generated from these fields
    (``engine.server.args``), so a field, its flag, its default and its check cannot drift apart."""

    max_num_seqs: int = _flag(64, "requests scheduled together")
    max_num_batched_tokens: int = _flag(1024, "tokens per step, prefill chunks and decodes", unit="tokens")
    max_model_len: int = _flag(4096, "prompt + completion limit, e.g. 4096 or 64k; auto (or -1): the longest "
                               "the KV cache holds", unit="tokens or auto")  # fmt: skip
    block_size: int = _flag(16, "tokens per KV block")
    kv_cache_memory: int = _flag(256 * 2**20, "bytes for the KV cache, e.g. 8GiB or 268435456",
                                 unit="bytes", unset=True)  # fmt: skip
    kv_cache_dtype: str = _flag("auto", "auto: the compute dtype; int8: NoPE dims int8 with a scale per row, "
                                "RoPE dims in the compute dtype, int8 index keys; fp8: the same in E4M3 "
                                "(CUDA and CPU, not Ascend A2/A3)", choices=KV_CACHE_DTYPES)  # fmt: skip
    engram_offload: bool = _flag(False, "keep the V4.1 Engram tables in (pinned) host memory: each step "
                                 "copies only the rows it reads to the device")  # fmt: skip
    seed: int = _flag(0, "seeds the requests that bring no seed")
    speculative_method: str | None = _flag(None, "mtp (V4) or dspark (V4.1)", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int | None = _flag(None, "drafts per step (default: 1 for mtp, the DSpark block)")
    dspark_min_confidence: float = _flag(0.0, "verify DSpark drafts while their confidence product >= this")
    enable_prefix_caching: bool | None = _flag(None, "reuse the KV of cached prompt prefixes, in pages "
                                               "(default: on)")  # fmt: skip
    prefix_page_size: int = _flag(256, "tokens per cached page: a multiple of every compress ratio, at least "
                                  "the sliding window")  # fmt: skip
    tensor_parallel_size: int = _flag(1, "ranks the model is split over, one process each", cli=False)
    data_parallel_size: int = _flag(1, "ranks with their own requests, scheduler and KV cache", cli=False)
    enable_expert_parallel: bool = _flag(False, "split the routed experts over the data-parallel ranks",
                                         cli=False)  # fmt: skip
    enforce_eager: bool = _flag(False, "capture no decode graphs: every step eager", cli=False)
    cpu_graphs: bool = _flag(False, "on the CPU, replay decode steps as graphs too (TorchScript, no Python "
                             "per op; seconds of capture per batch size at start)")  # fmt: skip

    @property
    def world_size(self) -> int:
        """Processes the engine runs on: one per tensor- or data-parallel rank."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def data_parallel(self) -> bool:
        """Whether the ranks are data-parallel engines (the routed experts split over them) rather than
        one engine's tensor-parallel shards."""
        return self.data_parallel_size > 1

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on: as asked, else on (under tensor and data parallel too)."""
        return self.enable_prefix_caching is not False

    @property
    def decode_width(self) -> int:
        """Tokens a verifying decode chunk computes as the flags give it (1 + drafts; DSpark's block
        default is the model's, counted as one draft here)."""
        return 1 + (self.num_speculative_tokens or (1 if self.speculative_method else 0))

    @property
    def lookahead(self) -> int:
        """KV positions past a sampling chunk that the named proposer's drafting writes, known before any
        model is built: the MTP layer chains its drafts there (``MtpProposer.lookahead``), DSpark does not."""
        return (self.num_speculative_tokens or 1) if self.speculative_method == "mtp" else 0

    def __post_init__(self) -> None:
        counts = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "prefix_page_size",
                  "tensor_parallel_size", "data_parallel_size")  # fmt: skip
        for name in counts:
            if (value := getattr(self, name)) < 1:
                raise ValueError(f"{name}={value} must be at least 1")
        if self.kv_cache_memory < 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory} must be at least 0 bytes")
        if not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed={self.seed} must be in [-2**63, 2**64)")
        if not 0.0 <= self.dspark_min_confidence < 1.0:
            raise ValueError(f"dspark_min_confidence={self.dspark_min_confidence} must be in [0, 1)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(
                f"speculative_method={self.speculative_method!r} must be one of {SPECULATIVE_METHODS}"
            )
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")
        dp = self.data_parallel_size
        if dp > 1 and (self.tensor_parallel_size > 1 or not self.enable_expert_parallel):
            raise ValueError(
                f"data_parallel_size={dp} runs with enable_expert_parallel=True and tensor_parallel_size=1 "
                f"for now (got {self.enable_expert_parallel} and {self.tensor_parallel_size})"
            )
