"""Speculative decoding never changes greedy output, whatever is proposed, and saves target passes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import Proposal, Request, SamplingParams
from engine.sampler import Sampler
from engine.spec_decode.dspark import DSparkProposer
from engine.spec_decode.proposer import Observation, Proposer, ScriptedProposer
from model.checkpoint import load_model
from model.testing.tiny import cached_tiny
from model.tokenizer import load_tokenizer

# Mixed lengths; 120..127 decode across the windows of ratio 128 (and 4, 2) closing at position 127.
LENGTHS = [1, 2, 3, 7, 16, 31, 60, 100, 120, 123, 124, 125, 126, 127, 200, 300]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
METHOD = {"v4": "mtp", "v4-dspark": "dspark", "v41": "dspark"}


@pytest.fixture(scope="module", params=list(METHOD))
def tiny(request):
    path = cached_tiny(request.param)
    return request.param, load_model(path), load_tokenizer(path)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def run(engine: LLMEngine, batch: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """Outputs, and the number of steps (target passes) the batch took."""
    requests = [engine.add_request(p, params) for p in batch]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < 1000
    assert engine.cache.num_free == engine.cache.num_blocks  # nothing leaked
    return [engine.completion(r).token_ids for r in requests], steps


def engine(tiny, proposer=None, k: int | None = 3, **config) -> LLMEngine:
    _, model, tokenizer = tiny
    method = None if proposer or k is None else METHOD[tiny[0]]
    cfg = EngineConfig(
        max_num_batched_tokens=96, speculative_method=method, num_speculative_tokens=k, **config
    )
    return LLMEngine(model, tokenizer, cfg, proposer)


def scripted(
    reference: dict[tuple[int, ...], list[int]], rule: Callable[[Request, int], bool]
) -> ScriptedProposer:
    """Proposes the target's own greedy tokens, made wrong at the draft positions where ``rule`` holds."""

    def script(request: Request, k: int) -> list[int]:
        right = reference[tuple(request.prompt)][len(request.output) : len(request.output) + k]
        first = request.num_tokens  # position of the first draft
        return [(t + 1) % 4096 if rule(request, first + j) else t for j, t in enumerate(right)]

    return ScriptedProposer(script)


@pytest.fixture(scope="module")
def reference(tiny):
    batch = prompts(tiny[1].cfg.vocab_size)
    outputs, steps = run(engine(tiny, k=None), batch, GREEDY)
    return batch, outputs, steps


def test_real_draft_head_keeps_greedy_output(tiny, reference):
    batch, outputs, _ = reference
    spec = engine(tiny)
    assert run(spec, batch, GREEDY)[0] == outputs
    stats = spec.spec_stats
    assert stats.verify_steps > 0 and stats.drafted == sum(stats.drafted_at)
    print(f"{METHOD[tiny[0]]}: accepted {stats.accepted}/{stats.drafted}, rate {stats.acceptance_rate}")


@pytest.mark.parametrize("where", ["never", "always", "at_close", "after_close"])
def test_scripted_drafts_keep_greedy_output(tiny, reference, where):
    """Right drafts, wrong ones, and drafts wrong exactly on the token that closes a compressor window
    (the call computed an entry that must vanish) or on the one right after (the entry stays)."""
    batch, outputs, steps_off = reference
    ratio = 2 if tiny[0] == "v41" else 4  # ratio 128 closes at multiples of 4 too
    rules = {
        "never": lambda r, pos: False,
        "always": lambda r, pos: True,
        "at_close": lambda r, pos: (pos + 1) % ratio == 0,
        "after_close": lambda r, pos: pos % ratio == 0,
    }
    spec = engine(tiny, scripted(dict(zip(map(tuple, batch), outputs, strict=True)), rules[where]))
    got, steps = run(spec, batch, GREEDY)
    assert got == outputs
    stats = spec.spec_stats
    if where == "never":
        assert stats.accepted == stats.drafted > 0 and steps < steps_off
    elif where == "always":
        assert stats.accepted == 0 and stats.drafted > 0
    else:
        assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("k", [1, 3])
def test_forced_accept_divides_the_target_passes(tiny, k):
    """One request alone: one pass for the prompt, then each pass emits k + 1 tokens."""
    _, model, _ = tiny
    prompt = prompts(model.cfg.vocab_size)[5]
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    [want], steps_off = run(engine(tiny, k=None), [prompt], params)
    assert steps_off == 17
    spec = engine(tiny, scripted({tuple(prompt): want}, lambda r, pos: False), k=k)
    [got], steps = run(spec, [prompt], params)
    assert got == want and steps == 1 + -(-16 // (k + 1))


class Recording(Proposer):
    """Runs a real draft head, records each request's committed tokens and first-draft logits, and
    proposes scripted tokens instead (so that several tokens a step get accepted)."""

    def __init__(self, inner: Proposer, script: ScriptedProposer):
        self.inner, self.script, self.lookahead = inner, script, inner.lookahead
        self.seen: list[tuple[list[int], torch.Tensor]] = []

    def propose(self, observations: list[Observation]) -> list[Proposal | None]:
        real = self.inner.propose(observations)
        for o, proposal in zip(observations, real, strict=True):
            if proposal is not None:
                self.seen.append((list(o.request.tokens), proposal.logits[0]))
        return self.script.propose(observations)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)


def dspark_features(model, committed: torch.Tensor) -> torch.Tensor:
    """DSpark's input for every committed token, computed from scratch."""
    batch = model.new_state().batch(len(committed), committed.device)
    return model.batch_forward(committed, batch, torch.tensor([len(committed) - 1]))[1]


def fresh_first_draft_logits(arch: str, model, tokens: list[int]) -> torch.Tensor:
    """The draft head's first-draft logits after ``tokens`` (the last one pending), from scratch."""
    committed = torch.tensor(tokens[:-1])
    if METHOD[arch] == "mtp":
        streams = model.hidden_streams(committed)
        layer = model.mtp[0]
        batch = model.new_state().batch(len(committed), committed.device)
        logits, _ = layer.predict(
            streams, torch.tensor(tokens[1:]), batch, model.rope(layer.plan.rope), model.embed, model.head
        )
        return logits[-1]
    features = dspark_features(model, committed)
    inv_freq = model.rope(model.mtp[0].plan.rope)
    state = model.mtp.new_state(committed.device)
    model.mtp.add_context(features, state, inv_freq)
    return model.mtp.propose([tokens[-1]], [state], model.embed, model.head, inv_freq)[0].logits[0]


def test_draft_caches_hold_exactly_the_committed_tokens(tiny, reference):
    """Whatever was drafted and rejected before, each step's draft head sees only committed tokens: its
    first draft equals the one a fresh draft head computes over the committed sequence."""
    arch, model, _ = tiny
    batch, outputs, _ = reference
    picked = [0, 4, 9, 13]  # lengths 1, 16, 123, 127
    spec = engine(tiny)
    rule = (lambda r, pos: pos % 4 == 1) if METHOD[arch] == "dspark" else (lambda r, pos: pos % 3 == 0)
    ref = dict(zip(map(tuple, batch), outputs, strict=True))
    spec.proposer = recording = Recording(spec.proposer, scripted(ref, rule))
    got, _ = run(spec, [batch[i] for i in picked], GREEDY)
    assert got == [outputs[i] for i in picked]
    assert 0 < spec.spec_stats.accepted < spec.spec_stats.drafted and len(recording.seen) >= 16
    for tokens, logits in recording.seen:
        torch.testing.assert_close(
            logits, fresh_first_draft_logits(arch, model, tokens), rtol=1e-4, atol=1e-4
        )


def test_seeded_sampling_with_drafts_is_reproducible(tiny, reference):
    batch = reference[0][:6]
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=i) for i in range(len(batch))]

    def sample(order: list[int]) -> list[list[int]]:
        spec = engine(tiny)
        requests = [spec.add_request(batch[i], params[i]) for i in order]
        while spec.has_work:
            spec.step()
        out = {r.prompt.__repr__(): r.output for r in requests}
        return [out[repr(batch[i])] for i in range(len(batch))]

    assert sample(list(range(6))) == sample([5, 3, 1, 0, 2, 4])


def test_bad_speculative_config(tiny):
    arch, model, tokenizer = tiny
    other = "dspark" if METHOD[arch] == "mtp" else "mtp"
    with pytest.raises(
        ValueError, match=f"speculative_method='{other}'.*use speculative_method='{METHOD[arch]}'"
    ):
        LLMEngine(model, tokenizer, EngineConfig(speculative_method=other))
    with pytest.raises(ValueError, match="speculative_method='eagle'"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match=r"num_speculative_tokens=0 must be in \[1, 16\]"):
        EngineConfig(speculative_method=METHOD[arch], num_speculative_tokens=0)
    if METHOD[arch] == "dspark":
        with pytest.raises(ValueError, match=r"num_speculative_tokens=6 must be in \[1, 5\]"):
            LLMEngine(model, tokenizer, EngineConfig(speculative_method="dspark", num_speculative_tokens=6))


@pytest.mark.parametrize("arch", ["v4-dspark", "v41"])
def test_dspark_confidence_picks_the_verify_length(arch):
    """With a threshold, a request verifies the longest prefix whose confidence product stays above it."""
    model = load_model(cached_tiny(arch))
    prompt = prompts(model.cfg.vocab_size)[6]
    committed = torch.tensor(prompt[:-1])
    features = dspark_features(model, committed)
    inv_freq = model.rope(model.mtp[0].plan.rope)
    state = model.mtp.new_state(committed.device)
    model.mtp.add_context(features, state, inv_freq)
    [draft] = model.mtp.propose([prompt[-1]], [state], model.embed, model.head, inv_freq)
    survival = torch.cumprod(draft.confidence, 0)
    assert torch.all(survival[1:] <= survival[:-1])
    thresholds = [
        (0.0, 5),
        *((float(s), k + 1) for k, s in enumerate(survival)),
        (float(survival[0]) + 1e-6, 0),
    ]
    for threshold, want in thresholds:
        proposer = DSparkProposer(model, Sampler(), 5, min_confidence=threshold)
        request = Request(prompt[:-1], GREEDY, output=prompt[-1:])
        [proposal] = proposer.propose([Observation(request, None, 0, features, 5)])
        assert (len(proposal.tokens) if proposal else 0) == want, threshold


def test_preempted_speculating_requests_start_over_cleanly(tiny, reference):
    """A cache too small for the batch preempts requests mid-speculation: their drafts and the draft
    head's context are dropped and rebuilt on recompute, and greedy output is unchanged."""
    batch, outputs, _ = reference
    probe = engine(tiny)
    lookahead, budget = probe.lookahead, probe.config.max_num_batched_tokens
    peak = probe.cache.max_blocks(max(LENGTHS) + MAX_TOKENS + lookahead, budget + lookahead)
    spec = engine(tiny, kv_cache_memory=(peak + 2) * probe.cache.block_bytes)
    assert run(spec, batch, GREEDY)[0] == outputs
    assert spec.scheduler.preemptions > 0 and spec.spec_stats.verify_steps > 0


@pytest.mark.parametrize(
    ("arch", "names"),
    [
        ("v4-dspark", ["mtp.2.markov_head.markov_w1.weight", "mtp.2.markov_head.markov_w2.weight",
                       "mtp.2.hc_head.hc_head_fn", "mtp.1.ffn.gate.weight"]),
        ("v41", ["mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight",
                 "mtp.2.hc_ffn_fn", "mtp.1.ffn.gate.weight"]),
    ],
)  # fmt: skip
def test_dspark_drafts_read_each_family_tensor(arch, names):
    """The draft distributions depend on the Markov tables, the final collapse and the stage routers
    of each family, under the family's own tensor names."""
    model = load_model(cached_tiny(arch))
    prompt = prompts(model.cfg.vocab_size)[6]
    features = dspark_features(model, torch.tensor(prompt[:-1]))
    inv_freq = model.rope(model.mtp[0].plan.rope)

    def draft_logits() -> torch.Tensor:
        state = model.mtp.new_state(features.device)
        model.mtp.add_context(features, state, inv_freq)
        return model.mtp.propose([prompt[-1]], [state], model.embed, model.head, inv_freq)[0].logits

    clean = draft_logits()
    params = dict(model.named_parameters())
    for name in names:
        saved = params[name].detach().clone()
        params[name].data.mul_(-1.5)
        changed = draft_logits()
        params[name].data.copy_(saved)
        assert not torch.allclose(changed, clean), name
    torch.testing.assert_close(draft_logits(), clean, rtol=0, atol=0)
