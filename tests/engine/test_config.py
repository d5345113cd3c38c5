"""EngineConfig refuses every out-of-range field at construction, naming the field, value and limit."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_num_seqs", 0, "max_num_seqs=0 must be at least 1"),
        ("max_num_batched_tokens", -4, "max_num_batched_tokens=-4 must be at least 1"),
        ("max_model_len", 0, "max_model_len=0 must be at least 1"),
        ("block_size", 0, "block_size=0 must be at least 1"),
        ("prefix_page_size", 0, "prefix_page_size=0 must be at least 1"),
        ("kv_cache_memory", -1, "kv_cache_memory=-1 must be at least 0 bytes"),
        ("seed", 2**64, r"seed=18446744073709551616 must be in \[-2\*\*63, 2\*\*64\)"),
        ("dspark_min_confidence", 1.0, r"dspark_min_confidence=1.0 must be in \[0, 1\)"),
        ("speculative_method", "eagle", "speculative_method='eagle' must be one of"),
        ("num_speculative_tokens", 17, r"num_speculative_tokens=17 must be in \[1, 16\]"),
    ],
)
def test_out_of_range_fields_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_the_defaults_and_the_limits_are_accepted() -> None:
    EngineConfig()
    EngineConfig(max_num_seqs=1, kv_cache_memory=0, seed=-(2**63), dspark_min_confidence=0.0)
