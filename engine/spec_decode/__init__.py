"""Speculative decoding: proposers draft tokens after each step; the next step verifies them.

The engine's step feeds a decoding request its pending token and K drafts, the sampler keeps the
accepted prefix (lossless, model-spec §8.3), the model runner rolls every cache back to it, and the
proposer, shown the committed tokens of the step, drafts again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sampler import Sampler
from engine.spec_decode.dspark import DSparkProposer
from engine.spec_decode.mtp import MtpProposer
from engine.spec_decode.proposer import Proposer
from model.cache import KVPools
from model.deepseek_v4 import DeepseekV4
from model.deepseek_v41 import DeepseekV41

if TYPE_CHECKING:
    from engine.llm_engine import EngineConfig


def build_proposer(
    config: EngineConfig,
    model: DeepseekV4 | DeepseekV41,
    pools: KVPools,
    sampler: Sampler,
    given: Proposer | None = None,
) -> tuple[Proposer | None, int]:
    """The proposer (``given``, else the one ``config`` names) and how many drafts it makes per step."""
    method, k = config.speculative_method, config.num_speculative_tokens
    if given is not None:
        if k is None:
            raise ValueError("a given proposer needs num_speculative_tokens")
        return given, k
    if method == "mtp":
        return MtpProposer(model, pools, sampler, k or 1), k or 1
    if method == "dspark":
        k = k or model.cfg.dspark_block_size
        return DSparkProposer(model, sampler, k, config.dspark_min_confidence), k
    return None, 0
