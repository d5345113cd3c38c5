"""The MoE router after its logits (model-spec §7): the sqrtsoftplus scores, the biased top-k of a
score-routed layer (or a hash layer's given experts) and the chosen experts' weights, in one pass.

Contract
    ``route(logits [S, E] fp32, bias [E] fp32 | None, hashed [S, k] int64 | None, k, temp, normalize,
    scaling) -> (picked [S, k] int64, weights [S, k] fp32)``::

        scores = sqrt(softplus(logits / temp))        softplus(x) = x above 20 (torch's threshold)
        picked = the k largest scores + bias, largest first, ties to the lower expert   (bias given)
               = hashed                                                                (hash layer)
        weights = scores[picked], / (their sum + 1e-20) when normalize, then * scaling

    Exactly one of ``bias`` and ``hashed`` is given; hashed ids lie in ``[0, E)`` (the checkpoint's
    ``tid2eid``; not checked on the host, that would synchronise). Limits: ``E <= MAX_EXPERTS``,
    ``1 <= k <= min(E, MAX_TOP_K)``.

Kernel
    One task is ``BLOCK_S`` rows of ``E_PAD`` logits (``E`` padded to a power of two). Selection takes
    the row maximum ``k`` times, each time the lowest expert holding it, then masks it out; the weights
    gather through the same one-hot. Expert ids travel as fp32 lanes (exact below 2**24): Ascend keeps
    fp32 compares on the vector unit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.spec import TuneConfig, Variant

MAX_EXPERTS = 512  # V4.1's 384, padded
MAX_TOP_K = 16
_SOFTPLUS_THRESHOLD = 20.0  # torch's default: softplus(x) = x above it
_NORM_EPS = 1e-20


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    hashed: torch.Tensor | None,
    k: int,
    temp: float,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(logits, bias, hashed, k, temp)
    run = route_triton if runtime.use_triton(logits) else route_ref
    return run(logits, bias, hashed, k, temp, normalize, scaling)


def _validate(
    logits: torch.Tensor, bias: torch.Tensor | None, hashed: torch.Tensor | None, k: int, temp: float
) -> None:
    if logits.dtype != torch.float32 or logits.dim() != 2 or not 1 <= logits.shape[1] <= MAX_EXPERTS:
        raise ValueError(
            f"logits: {logits.dtype} {tuple(logits.shape)} must be float32 [S, E <= {MAX_EXPERTS}]"
        )
    experts = logits.shape[1]
    if not 1 <= k <= min(experts, MAX_TOP_K):
        raise ValueError(f"k: {k} must lie in [1, {min(experts, MAX_TOP_K)}] (experts {experts})")
    if (bias is None) == (hashed is None):
        raise ValueError("bias / hashed: exactly one must be given (score routing or hash routing)")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (experts,)):
        raise ValueError(f"bias: {bias.dtype} {tuple(bias.shape)} must be float32 ({experts},)")
    if hashed is not None and (hashed.dtype != torch.int64 or hashed.shape != (logits.shape[0], k)):
        raise ValueError(f"hashed: {hashed.dtype} {tuple(hashed.shape)} must be int64 {(logits.shape[0], k)}")
    for name, x in (("bias", bias), ("hashed", hashed)):
        if x is not None and x.device != logits.device:
            raise ValueError(f"{name}: device {x.device} differs from logits' device {logits.device}")
    if not temp > 0:
        raise ValueError(f"temp: {temp} must be > 0")


def route_ref(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    hashed: torch.Tensor | None,
    k: int,
    temp: float,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Dividing or multiplying by 1.0 is exact: skipping it keeps every bit and saves an op.
    scores = torch.sqrt(F.softplus(logits if temp == 1.0 else logits / temp))
    picked = (scores + bias).topk(k, dim=-1).indices if hashed is None else hashed
    weights = scores.gather(1, picked)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
    return picked, weights if scaling == 1.0 else weights * scaling


@triton.jit
def _sqrt_softplus(x):
    """``sqrt(softplus(x))``, softplus as torch's: ``x`` above the threshold, else ``log1p(exp(x))`` with an
    accurate log1p (``log(u) * y / (u - 1)`` for ``u = 1 + y``: exact where ``u`` rounds to 1)."""
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    gap = u - 1.0  # 0 where u rounds to 1: log1p(y) is y there
    log1p = tl.where(gap == 0.0, y, tl.log(u) * (y / tl.where(gap == 0.0, 1.0, gap)))
    return tl.sqrt(tl.where(x > 20.0, x, log1p))


@triton.jit(do_not_specialize=["S"])
def _route_kernel(
    logits_ptr,
    bias_ptr,
    hashed_ptr,
    picked_ptr,
    weights_ptr,
    S,
    E,
    K,
    temp,
    scaling,
    HASHED: tl.constexpr,
    NORMALIZE: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    lane = experts.to(tl.float32)
    slots = tl.arange(0, K_PAD)
    for task in range(tl.program_id(0), tl.cdiv(S, BLOCK_S), tl.num_programs(0)):
        rows = task * BLOCK_S + tl.arange(0, BLOCK_S)
        live = rows < S
        at = logits_ptr + rows[:, None] * E + experts[None, :]
        logits = tl.load(at, mask=live[:, None] & (experts < E)[None, :], other=0.0)
        scores = _sqrt_softplus(logits / temp)
        chosen = tl.zeros([BLOCK_S, K_PAD], dtype=tl.float32)
        weights = tl.zeros([BLOCK_S, K_PAD], dtype=tl.float32)
        out = live[:, None] & (slots < K)[None, :]
        if HASHED:
            ids = tl.load(hashed_ptr + rows[:, None] * K + slots[None, :], mask=out, other=0)
            chosen = ids.to(tl.float32)
        else:
            bias = tl.load(bias_ptr + experts, mask=experts < E, other=0.0)
            biased = tl.where((experts < E)[None, :], scores + bias[None, :], float("-inf"))
            for j in range(0, K):
                best = tl.max(biased, axis=1)
                pick = tl.min(tl.where(biased == best[:, None], lane[None, :], E_PAD), axis=1)
                chosen = tl.where(slots[None, :] == j, pick[:, None], chosen)
                biased = tl.where(lane[None, :] == pick[:, None], float("-inf"), biased)
        for j in range(0, K):
            pick = tl.sum(tl.where(slots[None, :] == j, chosen, 0.0), axis=1)
            weight = tl.sum(tl.where(lane[None, :] == pick[:, None], scores, 0.0), axis=1)
            weights = tl.where(slots[None, :] == j, weight[:, None], weights)
        if NORMALIZE:
            weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
        weights = weights * scaling
        tl.store(weights_ptr + rows[:, None] * K + slots[None, :], weights, mask=out)
        if not HASHED:
            tl.store(picked_ptr + rows[:, None] * K + slots[None, :], chosen.to(tl.int64), mask=out)


def route_triton(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    hashed: torch.Tensor | None,
    k: int,
    temp: float,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    s, e = logits.shape
    picked = hashed if hashed is not None else logits.new_empty((s, k), dtype=torch.int64)
    weights = logits.new_empty((s, k))
    if s == 0:
        return picked, weights
    logits, e_pad = logits.contiguous(), triton.next_power_of_2(e)
    tuned = _route_tuned
    tuned[lambda meta: tuned.grid(triton.cdiv(s, meta["BLOCK_S"]))](
        logits,
        logits if bias is None else bias,  # never read when hashed
        picked,  # read when hashed, written otherwise
        picked,
        weights,
        s,
        e,
        k,
        temp,
        scaling,
        HASHED=hashed is not None,
        NORMALIZE=normalize,
        E_PAD=e_pad,
        K_PAD=triton.next_power_of_2(k),
    )
    return picked, weights


def _signature() -> dict[str, str]:
    pointers = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "hashed_ptr": "*i64", "picked_ptr": "*i64"}
    return {**pointers, "weights_ptr": "*fp32", "S": "i32", "E": "i32", "K": "i32", "temp": "fp32",
            "scaling": "fp32"}  # fmt: skip


# Per element of the [BLOCK_S, E_PAD] tile at the widest router: the logits, the scores and the biased
# scores, with the softplus temporaries; the [BLOCK_S, K_PAD] tiles are small beside it.
_CONFIGS = tuple(TuneConfig({"BLOCK_S": b}, 6 * 4 * b * MAX_EXPERTS) for b in (1, 4))
# The released routers: V4's 256 and V4.1's 384 experts, top 6, score-routed and hash layers, and the V4.1
# draft's 128 experts, top 3, score-routed.
_VARIANTS = tuple(
    Variant({"HASHED": hashed, "NORMALIZE": 1, "E_PAD": e_pad, "K_PAD": 8}, (_signature(),))
    for e_pad in (256, 512)
    for hashed in (0, 1)
) + (Variant({"HASHED": 0, "NORMALIZE": 1, "E_PAD": 128, "K_PAD": 4}, (_signature(),)),)
_route_tuned = tuning.TunedKernel(_route_kernel, _CONFIGS, key=["E"], variants=_VARIANTS)
KERNELS = (_route_tuned,)
