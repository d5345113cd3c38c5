"""Speculative decoding: proposers draft tokens after each step; the next step verifies them.

The engine's step feeds a decoding request its pending token and K drafts, the sampler keeps the
accepted prefix (lossless, model-spec §8.3), the model runner rolls every cache back to it, and the
proposer, shown the committed tokens of the step, drafts again.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.config import EngineConfig
from engine.sampler import Sampler
from engine.spec_decode.dspark import DSparkProposer
from engine.spec_decode.mtp import MtpProposer
from engine.spec_decode.proposer import Proposer
from model.cache import KVPools
from model.causal_lm import CausalLM


def build_proposer(
    config: EngineConfig,
    model: CausalLM,
    pools: KVPools,
    sampler: Sampler,
    given: Proposer | None = None,
    share: Callable[[list[int]], list[int]] = list,
) -> tuple[Proposer | None, int]:
    """The proposer (``given``, else the one ``config`` names) and how many drafts it makes per step;
    ``share``: how the MTP chain sees the drafts it feeds back (``ModelRunner.share``)."""
    method, k = config.speculative_method, config.num_speculative_tokens
    if given is not None:
        if k is None:
            raise ValueError("a given proposer needs num_speculative_tokens")
        return given, k
    if method is not None:
        _check_draft_head(method, model)
    if method == "mtp":  # its drafts, chained one a position past the chunk: the config's lookahead
        return MtpProposer(model, pools, sampler, config.lookahead, share), config.lookahead
    if method == "dspark":
        k = k or model.cfg.dspark.block_size
        return DSparkProposer(model, sampler, k, config.dspark_min_confidence), k
    return None, 0


def _check_draft_head(method: str, model: CausalLM) -> None:
    """The draft head ``method`` needs is the one the checkpoint has."""
    cfg = model.cfg
    if not cfg.num_draft_layers:
        raise ValueError(
            f"speculative_method={method!r}: this checkpoint has no draft tensors (mtp.*), so speculative "
            "decoding is unavailable; serve it without a speculative method"
        )
    if method == "mtp" and cfg.is_dspark:
        raise ValueError(
            "speculative_method='mtp': this checkpoint's draft head is DSpark (its config has dspark_* "
            "keys), not a V4 MTP layer; use speculative_method='dspark'"
        )
    if method == "dspark" and not cfg.is_dspark:
        raise ValueError(
            "speculative_method='dspark': this checkpoint has a V4 MTP draft layer and no DSpark stages "
            "(no dspark_* keys); use speculative_method='mtp'"
        )
