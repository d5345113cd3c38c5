"""Fused MoE grouped GEMM over packed routed experts (model-spec §7, weights as in §9.1).

Contract
    ``moe_gemm(x [T, D] fp32 | bf16, topk_ids [T, k] int32 | int64, topk_weights [T, k] fp32,
    experts: RoutedExperts, shared: [T, D] | None = None) -> [T, D]``, dtype of ``x`` (fp32 with
    ``shared``), fp32 maths, where ``RoutedExperts(w1, w3: QuantWeight [E, I, D], w2: QuantWeight
    [E, D, I], swiglu_limit: float | None)`` is checked once::

        y[t] = sum_j topk_weights[t, j] * W2_e(silu(min(W1_e x[t], L)) * clamp(W3_e x[t], -L, L))
        with e = topk_ids[t, j]

    ``shared`` (the shared expert's output, dtype of ``x``) is added in fp32 to ``y`` rounded to the dtype
    of ``x``: the MoE block's sum as the model rounds it, before the block's own rounding or all-reduce.

    ``L = swiglu_limit`` (``None``: no clamp). A choice whose id is outside ``[0, E)`` (``-1``: none) adds
    nothing; ids are not range-checked on the host (that would synchronise). The experts are stacks of
    ``quant_matmul`` weights of ``[E, N, ...]`` (``dense_weight``, ``fp8_weight``, ``mxfp4_weight``,
    ``int8_weight``, ``int4_weight``): ``w1`` and ``w3`` share a format, ``w2`` has its own; weights stay
    packed. The integer formats (W8A8, W4A8) quantise the tokens per row (symmetric int8, dynamic), and
    the SwiGLU output per row again before ``w2``; int32 accumulation. The sum over ``j`` runs in slot
    order.

Routing
    ``sort_by_expert`` orders the ``T * k`` choices by expert (stable: tokens ascending within an
    expert, dropped choices last) and gives each expert's row range ``offsets[e]:offsets[e + 1]``.
    Experts with no token have an empty range and cost one scalar load per program. The CPU reference
    runs dense fp32 experts as three grouped GEMMs over those ranges, and walks the others expert by
    expert, decoding one tile of weight rows at a time.

Kernels
    One ``@triton.jit`` body, two launches. ``GATE_UP``: for each expert and each ``BLOCK_M`` tile of its
    sorted rows and ``BLOCK_N`` slice of ``I``, gathers the tokens' rows of ``x`` once per K slice for
    both GEMMs (``quant_matmul.packed_matmul_tile`` with a pair of weights) and stores the clamped
    SwiGLU in fp32 (``h [S, I]``, S = T * k). The second launch multiplies ``h`` by ``W2_e``, scales
    each row by its routing weight and stores it in sorted order (``[S, D]`` fp32, dense tiles, no
    scatter). The combine (``_combine_kernel``) gathers each token's ``k`` rows back, sums them in slot
    order and adds ``shared``, one launch; the dropped choices' rows are never written, and it reads
    them as 0 (no zero fill). Tasks (expert, row tile, column tile) are dealt round
    robin over a persistent grid; the expert's weights are reached by a pointer advanced once per
    expert (the release's FP8 stacks exceed int32 byte offsets). The integer formats run
    ``quant_matmul.int_matmul_tile`` (int8 dots) and rescale by the row's and the channel's scales. An
    int4 column tile is one nibble of ``BLOCK_N`` byte rows, i.e. every other output column: its weight
    tile stays affine, one dot covers it, and its store is strided by two. Weight, ``h`` and output tiles are
    affine with range masks (rectangular sub-views on Ascend); the gathered ``x`` rows use token 0 for
    the rows past the expert's range and clamped columns, so no lane reads outside ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels import runtime, tuning
from triton_kernels.quant import quantize_int8_ref
from triton_kernels.quant_matmul import (
    DENSE,
    FORMAT_IDS,
    INTEGER_FORMATS,
    PACKED_CONFIGS,
    QuantWeight,
    check_activations,
    int_matmul_tile,
    packed_matmul_tile,
    packed_ub,
    quant_matmul_ref,
)
from triton_kernels.spec import TuneConfig, Variant

_ID_DTYPES = (torch.int32, torch.int64)
_SWIGLU_DTYPES = (torch.float32, torch.bfloat16)
_MAX_INT32 = 2**31 - 1


@dataclass(frozen=True)
class ExpertRouting:
    """The choices sorted by expert: ``S = T * k`` rows, rows ``>= offsets[E]`` are dropped choices."""

    tokens: torch.Tensor  # [S] int32: the token of each sorted row
    weights: torch.Tensor  # [S] fp32: its routing weight
    offsets: torch.Tensor  # [E + 1] int32: expert e owns rows offsets[e]:offsets[e + 1]
    inverse: torch.Tensor  # [T * k] int64: the sorted row of choice t * k + j


def sort_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> ExpertRouting:
    flat = topk_ids.reshape(-1).long()
    keyed = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.argsort(keyed, stable=True)
    # Each expert's first sorted row, found on the device (bincount would read its size back).
    bounds = torch.arange(num_experts + 1, device=flat.device)
    offsets = torch.searchsorted(keyed[order], bounds).to(torch.int32)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=flat.device)
    tokens = (order // max(1, topk_ids.shape[1])).to(torch.int32)
    return ExpertRouting(tokens, topk_weights.reshape(-1)[order].contiguous(), offsets, inverse)


@triton.jit
def _expert_keys(ids_ptr, choices, S, E):
    """Each choice's expert, int32 (the range check in the ids' dtype: an int64 id is not wrapped first);
    an id outside ``[0, E)`` and a lane past ``S`` get ``E``: dropped, sorted last."""
    ids = tl.load(ids_ptr + choices, mask=choices < S, other=-1)
    return tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)


@triton.jit(do_not_specialize=["S"])
def _route_kernel(
    ids_ptr, w_ptr, tok_ptr, rw_ptr, off_ptr, inv_ptr, S, K, E, E_PAD: tl.constexpr, BLOCK: tl.constexpr
):
    """One program: ``sort_by_expert`` of the ``S = T * k`` choices ``ids [S]`` (int32 | int64) and
    ``w [S]`` fp32 into ``tok`` / ``rw`` ``[S + BLOCK]`` (rows past ``S`` are scratch), ``off [E + 1]``
    and ``inv [S]`` int64, ``E < E_PAD``, ``S + BLOCK <= 2**24``. Pass 1: a histogram of the experts,
    whose exclusive cumsum is the offsets. Pass 2, block by block: a choice's row is its expert's next
    row (carried across blocks) plus the number of earlier choices of its block with the same expert."""
    experts, lanes = tl.arange(0, E_PAD), tl.arange(0, BLOCK)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, S, BLOCK):
        counts += tl.histogram(_expert_keys(ids_ptr, start + lanes, S, E), E_PAD)
    next_row = tl.cumsum(counts, axis=0) - counts
    tl.store(off_ptr + experts, next_row, mask=experts <= E)
    earlier = lanes[None, :] < lanes[:, None]
    for start in range(0, S, BLOCK):
        choices = start + lanes
        live = choices < S
        keys = _expert_keys(ids_ptr, choices, S, E)
        rank = tl.sum(((keys[:, None] == keys[None, :]) & earlier).to(tl.int32), axis=1)
        # Ascend gathers floats only: fp32 holds the rows exactly (below 2**24).
        rows = tl.gather(next_row.to(tl.float32), keys, 0).to(tl.int32) + rank
        next_row += tl.histogram(keys, E_PAD)
        tl.store(inv_ptr + choices, rows.to(tl.int64), mask=live)
        # Unmasked scatters: the lanes past S are the last dropped choices, rows S .. S + BLOCK - 1, which
        # no live lane shares (a masked scatter may write masked lanes back on Ascend).
        tl.store(tok_ptr + rows, choices // K)
        tl.store(rw_ptr + rows, tl.load(w_ptr + choices, mask=live, other=0.0))


def sort_by_expert_triton(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> ExpertRouting:
    """``sort_by_expert`` in one launch, its fields views of one allocation."""
    e_pad = triton.next_power_of_2(num_experts + 1)
    if e_pad > _ROUTE_MAX_E_PAD:
        raise ValueError(f"num_experts: {num_experts} exceeds the routing kernel's {_ROUTE_MAX_E_PAD - 1}")
    s, rows = topk_ids.numel(), topk_ids.numel() + _ROUTE_SPARE_ROWS
    if rows > _ROUTE_MAX_ROWS:
        raise ValueError(
            f"topk_ids: {s} choices exceed the routing kernel's {_ROUTE_MAX_ROWS - _ROUTE_SPARE_ROWS}"
        )
    # int32 words: inverse (int64), tokens, weights (fp32), offsets.
    words = torch.empty(2 * s + 2 * rows + num_experts + 1, dtype=torch.int32, device=topk_ids.device)
    inverse = words[: 2 * s].view(torch.int64)
    tokens, weights = words[2 * s : 2 * s + rows], words[2 * s + rows : 2 * s + 2 * rows].view(torch.float32)
    offsets = words[2 * s + 2 * rows :]
    _route_tuned[_route_tuned.grid(1)](
        topk_ids.reshape(-1), topk_weights.reshape(-1), tokens, weights, offsets, inverse, s,
        max(1, topk_ids.shape[1]), num_experts, E_PAD=e_pad,
    )  # fmt: skip
    return ExpertRouting(tokens[:s], weights[:s], offsets, inverse)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """The clamped SwiGLU of one expert's projections (the shared expert's, outside ``moe_gemm``)."""
    if gate.dtype not in _SWIGLU_DTYPES or up.dtype != gate.dtype or up.shape != gate.shape:
        raise ValueError(
            f"gate / up: {gate.dtype} {tuple(gate.shape)} and {up.dtype} {tuple(up.shape)} must be of one"
            f" shape and one dtype of {_SWIGLU_DTYPES}"
        )
    if up.device != gate.device:
        raise ValueError(f"up: device {up.device} differs from gate's device {gate.device}")
    if gate.numel() > _MAX_INT32:
        raise ValueError(f"gate: {gate.numel()} elements exceeds the limit {_MAX_INT32}")
    return (swiglu_triton if runtime.use_triton(gate) else swiglu_ref)(gate, up, limit)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    g, u = gate.float(), up.float()
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (torch.nn.functional.silu(g) * u).to(gate.dtype)


@triton.jit(do_not_specialize=["M"])
def _swiglu_kernel(
    gate_ptr, up_ptr, out_ptr, M, N, gate_stride, up_stride, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr
):
    tiles = tl.cdiv(N, BLOCK)
    for task in range(tl.program_id(0), M * tiles, tl.num_programs(0)):
        row = task // tiles
        cols = (task % tiles) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(gate_ptr + row * gate_stride + cols, mask=cols < N, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * up_stride + cols, mask=cols < N, other=0.0).to(tl.float32)
        if CLAMP:
            g, u = tl.minimum(g, limit), tl.minimum(tl.maximum(u, -limit), limit)
        out = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * N + cols, out, mask=cols < N)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    # Rows at any stride (the column ranges of one GEMM's output), columns contiguous.
    gate2, up2 = (t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1) for t in (gate, up))
    gate2, up2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate2, up2))
    (m, n), out = gate2.shape, torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if m * n:
        tuned = _swiglu_tuned
        tuned[lambda meta: tuned.grid(m * triton.cdiv(n, meta["BLOCK"]))](
            gate2, up2, out, m, n, gate2.stride(0), up2.stride(0), 0.0 if limit is None else limit,
            CLAMP=limit is not None,
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class RoutedExperts:
    """One MoE layer's packed routed experts, checked once: ``w1`` / ``w3`` [E, I, D], ``w2`` [E, D, I]."""

    w1: QuantWeight
    w3: QuantWeight
    w2: QuantWeight
    swiglu_limit: float | None

    def __post_init__(self) -> None:
        w1, w3, w2, experts = self.w1, self.w3, self.w2, self.w1.num_experts
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            if w.format not in FORMAT_IDS:
                raise ValueError(
                    f"{name}: format {w.format!r} not supported, expected one of {tuple(FORMAT_IDS)}"
                )
            if w.num_experts != experts or experts < 1:
                raise ValueError(
                    f"{name}: {w.num_experts} experts, expected a stack of w1's {experts} (>= 1)"
                )
            if w.data.stride(0) > _MAX_INT32 or w.scale.stride(0) > _MAX_INT32:
                raise ValueError(f"{name}: one expert's bytes exceed {_MAX_INT32}")
        if (w3.format, w3.block, w3.data.shape) != (w1.format, w1.block, w1.data.shape):
            raise ValueError(
                f"w3: {w3.format} {tuple(w3.data.shape)} must match w1: {w1.format} {tuple(w1.data.shape)}"
            )
        if (w2.out_features, w2.in_features) != (self.hidden, self.inter):
            raise ValueError(
                f"w2: [{w2.out_features}, {w2.in_features}] each, expected [{self.hidden}, {self.inter}]"
            )
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit: {self.swiglu_limit} must be > 0 or None")

    @property
    def num_experts(self) -> int:
        return self.w1.num_experts

    @property
    def hidden(self) -> int:
        return self.w1.in_features

    @property
    def inter(self) -> int:
        return self.w1.out_features


def moe_gemm(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: RoutedExperts,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    _validate(x, topk_ids, topk_weights, experts, shared)
    if runtime.use_triton(x):
        return moe_gemm_triton(x, topk_ids, topk_weights, experts, shared)
    return moe_gemm_ref(x, topk_ids, topk_weights, experts, shared)


def _validate(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: RoutedExperts,
    shared: torch.Tensor | None,
) -> None:
    check_activations("x", x, experts.w1.expert(0))
    if shared is not None and (
        shared.shape != x.shape or shared.dtype != x.dtype or shared.device != x.device
    ):
        raise ValueError(
            f"shared: {shared.dtype} {tuple(shared.shape)} on {shared.device} must be x's {x.dtype}"
            f" {tuple(x.shape)} on {x.device}"
        )
    t, width = x.shape[0], max(experts.hidden, experts.inter)
    if topk_ids.dtype not in _ID_DTYPES or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(
            f"topk_ids: {topk_ids.dtype} {tuple(topk_ids.shape)} must be [{t}, k] of {_ID_DTYPES}"
        )
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights: {topk_weights.dtype} {tuple(topk_weights.shape)} must be fp32"
            f" {tuple(topk_ids.shape)}"
        )
    if topk_ids.device != x.device or topk_weights.device != x.device:
        raise ValueError(f"topk_ids / topk_weights: devices must be x's {x.device}")
    if topk_ids.numel() * width > _MAX_INT32:
        raise ValueError(f"topk_ids: {topk_ids.numel()} choices x {width} exceed {_MAX_INT32}")


def moe_gemm_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: RoutedExperts,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each expert's sorted rows at once; ``quant_matmul_ref`` decodes one tile of its rows at a time and
    quantises the integer formats' activations per row (the tokens, then the SwiGLU output)."""
    t, k = topk_ids.shape
    routing = sort_by_expert(topk_ids, topk_weights, experts.num_experts)
    rows, weights = x[routing.tokens].float(), routing.weights[:, None]  # gathered once, in expert order
    y = (_fp32_experts if dense_fp32(experts) else _decoded_experts)(rows, routing, experts) * weights
    return combine_ref(y, routing.inverse, k, x.dtype, shared)


def dense_fp32(experts: RoutedExperts) -> bool:
    """Every stack stored dense in fp32: the reference runs them as grouped GEMMs, with no host read."""
    stacks = (experts.w1, experts.w3, experts.w2)
    return all(w.format == DENSE and w.data.dtype == torch.float32 for w in stacks)


def combine_ref(
    y: torch.Tensor, inverse: torch.Tensor, k: int, dtype: torch.dtype, shared: torch.Tensor | None
) -> torch.Tensor:
    """Each token's ``k`` rows of ``y`` (fp32, sorted order) summed, in ``dtype``; plus ``shared`` in fp32."""
    out = y[inverse].view(-1, k, y.shape[1]).sum(1).to(dtype)
    return out if shared is None else out.float() + shared.float()


def _fp32_experts(rows: torch.Tensor, routing: ExpertRouting, experts: RoutedExperts) -> torch.Tensor:
    """The sorted rows through dense fp32 experts, nothing to decode: three grouped GEMMs for all experts."""
    ends = routing.offsets[1:]

    def grouped(a: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        return torch._grouped_mm(a, w.data.transpose(1, 2), offs=ends)

    h = swiglu_ref(grouped(rows, experts.w1), grouped(rows, experts.w3), experts.swiglu_limit)
    # The grouped GEMM leaves the rows past the last expert's (dropped choices) unwritten.
    kept = torch.arange(rows.shape[0], device=rows.device) < ends[-1]
    return torch.where(kept[:, None], grouped(h, experts.w2), 0.0)


def _decoded_experts(rows: torch.Tensor, routing: ExpertRouting, experts: RoutedExperts) -> torch.Tensor:
    """The sorted rows through their experts' stored weights, expert by expert, each decoded to fp32 one
    tile at a time (dropped rows stay 0)."""
    y = torch.zeros((rows.shape[0], experts.hidden), dtype=torch.float32, device=rows.device)
    bounds = routing.offsets.tolist()  # the reference runs where the tensors live in host memory
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if lo == hi:
            continue
        xe = rows[lo:hi]
        gate, up = quant_matmul_ref(xe, experts.w1.expert(e)), quant_matmul_ref(xe, experts.w3.expert(e))
        y[lo:hi] = quant_matmul_ref(swiglu_ref(gate, up, experts.swiglu_limit), experts.w2.expert(e))
    return y


@triton.jit
def _moe_kernel(
    a_ptr,
    as_ptr,
    tok_ptr,
    off_ptr,
    rw_ptr,
    w_ptr,
    s_ptr,
    w3_ptr,
    s3_ptr,
    out_ptr,
    N,
    NW,
    K,
    SK,
    E,
    w_stride,
    s_stride,
    limit,
    GATE_UP: tl.constexpr,
    FORMAT: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    # int4 holds two output rows per byte row (NW = N / 2): a column tile takes one nibble of BLOCK_N byte
    # rows (every other output column), so its weight tile stays affine and one dot covers it.
    parities = N // NW
    n_tiles = tl.cdiv(NW, BLOCK_N) * parities
    task = 0
    w_e, s_e, w3_e, s3_e = w_ptr, s_ptr, w3_ptr, s3_ptr
    for e in range(E):
        lo = tl.load(off_ptr + e)
        hi = tl.load(off_ptr + e + 1)
        expert_tasks = tl.cdiv(hi - lo, BLOCK_M) * n_tiles
        # Tasks are dealt round robin: this program's first task of the expert, then every programs-th.
        for t in range((pid - task % programs + programs) % programs, expert_tasks, programs):
            rows = lo + (t // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < hi
            j0 = (t % n_tiles) // parities * BLOCK_N
            parity = t % parities
            wrows = j0 + tl.arange(0, BLOCK_N)
            cols = wrows * parities + parity
            col_ok = wrows < NW
            if GATE_UP:
                # Token 0 stands in for the rows past the expert's: every gathered address is valid.
                a_idx = tl.load(tok_ptr + rows, mask=row_ok, other=0)
            else:
                a_idx = rows
            a_rows = a_ptr + a_idx[:, None] * K
            if FORMAT >= 3:
                acc_q, acc2_q = int_matmul_tile(
                    a_rows, row_ok, w_e, w3_e, wrows, col_ok, K, 28 - 4 * parity, GATE_UP, GATE_UP,
                    FORMAT == 4, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
                a_scale = tl.load(as_ptr + a_idx, mask=row_ok, other=0.0)[:, None]
                acc = acc_q.to(tl.float32) * a_scale * tl.load(s_e + cols, mask=col_ok, other=0.0)[None, :]
                acc2 = acc2_q.to(tl.float32) * a_scale * tl.load(s3_e + cols, mask=col_ok, other=0.0)[None, :]
            else:
                acc, acc2 = packed_matmul_tile(
                    a_rows, row_ok, w_e, s_e, w3_e, s3_e, j0, N, K, SK, GATE_UP, GATE_UP,
                    FORMAT, SCALE_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
            if GATE_UP:
                gate = tl.minimum(acc, limit)
                up = tl.minimum(tl.maximum(acc2, -limit), limit)
                y = gate / (1.0 + tl.exp(-gate)) * up
            else:
                y = acc * tl.load(rw_ptr + rows, mask=row_ok, other=0.0)[:, None]
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])
        task += expert_tasks
        w_e += w_stride
        s_e += s_stride
        w3_e += w_stride
        s3_e += s_stride


def _launch(
    tuned: tuning.TunedKernel,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    routing: ExpertRouting,
    w: QuantWeight,
    w3: QuantWeight,
    out: torch.Tensor,
    limit: float,
    gate_up: bool,
) -> None:
    rows, n, k, experts = routing.tokens.numel(), out.shape[1], w.in_features, w.num_experts
    n_weight = w.data.shape[1]  # weight rows: N, or N / 2 int4 byte rows

    def grid(meta: dict[str, int]) -> tuple[int]:
        tiles = (triton.cdiv(rows, meta["BLOCK_M"]) + experts) * triton.cdiv(n_weight, meta["BLOCK_N"])
        return tuned.grid(tiles * (n // n_weight))

    # Dense weights have no scale: the activation scales stand in (never read, the stride is 0).
    dense = w.format == DENSE
    scale, scale3 = (a_scale, a_scale) if dense else (w.scale, w3.scale)
    tuned[grid](
        a,
        a_scale,
        routing.tokens,
        routing.offsets,
        routing.weights,
        w.data,
        scale,
        w3.data,
        scale3,
        out,
        n,
        n_weight,
        k,
        max(1, w.scale.shape[-1]),
        experts,
        w.data.stride(0),
        0 if dense else scale.stride(0),
        limit,
        GATE_UP=gate_up,
        FORMAT=FORMAT_IDS[w.format],
        SCALE_BLOCK=w.block,
    )


def _activations(x: torch.Tensor, fmt: str, unread: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a launch reads as ``a``: int8 rows and their scales for the integer formats (the rounding of
    ``quant_matmul_ref``), else the rows themselves, with ``unread`` (any fp32 tensor) as the scale."""
    if fmt in INTEGER_FORMATS:
        return quantize_int8_ref(x)
    return x.contiguous(), unread


def moe_gemm_triton(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: RoutedExperts,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    k = topk_ids.shape[1]
    if not topk_ids.numel():
        return x.new_zeros(x.shape) if shared is None else shared.float()
    routing = sort_by_expert_triton(topk_ids, topk_weights, experts.num_experts)
    rows, inter, hidden_size = topk_ids.numel(), experts.inter, x.shape[1]
    # The dropped rows (past offsets[E]) are never written: the integer formats quantise them unread,
    # and the combine reads them as 0.
    hidden = torch.empty((rows, inter), dtype=torch.float32, device=x.device)
    y = torch.empty((rows, hidden_size), dtype=torch.float32, device=x.device)
    limit = float("inf") if experts.swiglu_limit is None else float(experts.swiglu_limit)
    # The routing weights stand in for the scales the dense and packed formats never read.
    a, a_scale = _activations(x, experts.w1.format, routing.weights)
    _launch(_gate_up_tuned, a, a_scale, routing, experts.w1, experts.w3, hidden, limit, gate_up=True)
    # The integer formats quantise the SwiGLU output per row again before w2 (a dynamic per-token
    # scale, as Ascend's grouped W8A8 / W4A8 path does).
    h, h_scale = _activations(hidden, experts.w2.format, routing.weights)
    _launch(_down_tuned, h, h_scale, routing, experts.w2, experts.w2, y, limit, gate_up=False)
    return combine_triton(y, routing.inverse, k, x.dtype, shared, routing.offsets[-1:])


@triton.jit(do_not_specialize=["T"])
def _combine_kernel(
    y_ptr, inv_ptr, kept_ptr, shared_ptr, out_ptr, T, K, D, SHARED: tl.constexpr, BLOCK_D: tl.constexpr
):
    kept = tl.load(kept_ptr)
    tiles = tl.cdiv(D, BLOCK_D)
    for task in range(tl.program_id(0), T * tiles, tl.num_programs(0)):
        t = task // tiles
        d = (task % tiles) * BLOCK_D + tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in range(K):
            row = tl.load(inv_ptr + t * K + j)
            width = tl.where(row < kept, D, 0)  # a dropped choice's row reads as 0
            acc += tl.load(y_ptr + row * D + d, mask=d < width, other=0.0)
        if SHARED:
            s = tl.load(shared_ptr + t * D + d, mask=d < D, other=0.0)
            acc = acc.to(s.dtype).to(tl.float32) + s.to(tl.float32)
        tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=d < D)


def combine_triton(
    y: torch.Tensor,
    inverse: torch.Tensor,
    k: int,
    dtype: torch.dtype,
    shared: torch.Tensor | None,
    kept: torch.Tensor,
) -> torch.Tensor:
    """``combine_ref``, reading the rows of ``y`` from ``kept [1]`` on (the dropped choices') as 0."""
    t, d = inverse.numel() // k, y.shape[1]
    out = y.new_empty((t, d), dtype=dtype if shared is None else torch.float32)
    tuned = _combine_tuned
    tuned[lambda meta: tuned.grid(t * triton.cdiv(d, meta["BLOCK_D"]))](
        y,
        inverse,
        kept,
        y if shared is None else shared.contiguous(),
        out,
        t,
        k,
        d,
        SHARED=shared is not None,
    )
    return out


def _gate_up_ub(block_m: int, block_n: int, block_k: int) -> int:
    # One GEMM step (the second weight's slice is decoded after the first dot), the second accumulator,
    # the SwiGLU temporaries and the gathered token ids.
    return packed_ub(block_m, block_n, block_k) + 4 * (4 * block_m * block_n + block_m)


_GATE_UP_CONFIGS = (
    TuneConfig({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}, _gate_up_ub(16, 32, 64)),
    TuneConfig({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128}, _gate_up_ub(16, 16, 128)),
)
_DOWN_CONFIGS = PACKED_CONFIGS[:2]
_KEY = ["N", "K", "FORMAT", "SCALE_BLOCK"]


def _signature(a: str, w: str = "*u8", s: str = "*u8") -> dict[str, str]:
    pointers = {"a_ptr": a, "as_ptr": "*fp32", "tok_ptr": "*i32", "off_ptr": "*i32", "rw_ptr": "*fp32"}
    weights = {"w_ptr": w, "s_ptr": s, "w3_ptr": w, "s3_ptr": s}
    ints = dict.fromkeys(("N", "NW", "K", "SK", "E", "w_stride", "s_stride"), "i32")
    return {**pointers, **weights, "out_ptr": "*fp32", **ints, "limit": "fp32"}


def _variants(gate_up: int) -> tuple[Variant, ...]:
    """Every format's (FORMAT, SCALE_BLOCK) with the dtypes it launches with: the gate / up GEMM reads the
    tokens (fp32 or bf16; int8 for the integer formats), the down GEMM the fp32 SwiGLU output (int8)."""
    a = ("*fp32", "*bf16") if gate_up else ("*fp32",)
    packed = tuple(_signature(x) for x in a)
    if gate_up:  # the tokens and the weights in the compute dtype
        dense = tuple(_signature(x, x, "*fp32") for x in a)
    else:
        dense = tuple(_signature("*fp32", w, "*fp32") for w in ("*fp32", "*bf16"))
    integer = (_signature("*i8", "*i8", "*fp32"),)
    formats = (((0, 128), packed), ((0, 32), packed), ((1, 32), packed), ((2, 1), dense), ((3, 1), integer),
               ((4, 1), integer))  # fmt: skip
    return tuple(
        Variant({"GATE_UP": gate_up, "FORMAT": fmt, "SCALE_BLOCK": block}, signatures)
        for (fmt, block), signatures in formats
    )


_gate_up_tuned, _down_tuned = (
    tuning.TunedKernel(
        _moe_kernel,
        _GATE_UP_CONFIGS if gate_up else _DOWN_CONFIGS,
        key=_KEY,
        name="gate_up" if gate_up else "down",
        variants=_variants(gate_up),
        uses_cube=True,
        never_one=("K",),  # MXFP4 K holds whole 32-value groups (see quant_matmul)
    )
    for gate_up in (1, 0)
)


_ROUTE_MAX_E_PAD = 512  # the histograms the footprints are declared for: up to 511 experts
_ROUTE_MAX_ROWS = 2**24  # rows gathered in fp32


def _route_ub(block: int) -> int:
    # The [BLOCK, BLOCK] compare and its int32 sum operand, the histograms, next rows and their fp32 copy.
    return 4 * 2 * block * block + 4 * 4 * _ROUTE_MAX_E_PAD + 4 * 8 * block


_ROUTE_CONFIGS = tuple(TuneConfig({"BLOCK": b}, _route_ub(b), multibuffer=False) for b in (16, 32))
_ROUTE_SPARE_ROWS = max(c.params["BLOCK"] for c in _ROUTE_CONFIGS)


def _route_signature(ids: str) -> dict[str, str]:
    pointers = {"ids_ptr": ids, "w_ptr": "*fp32", "tok_ptr": "*i32", "rw_ptr": "*fp32", "off_ptr": "*i32"}
    return {**pointers, "inv_ptr": "*i64", "S": "i32", "K": "i32", "E": "i32"}


_route_tuned = tuning.TunedKernel(
    _route_kernel,
    _ROUTE_CONFIGS,
    key=["S", "E"],
    name="route",
    variants=(Variant({"E_PAD": _ROUTE_MAX_E_PAD}, (_route_signature("*i32"), _route_signature("*i64"))),),
)


def _swiglu_signature(x: str) -> dict[str, str]:
    ints = dict.fromkeys(("M", "N", "gate_stride", "up_stride"), "i32")
    return {"gate_ptr": x, "up_ptr": x, "out_ptr": x, **ints, "limit": "fp32"}


# Per element: both inputs as loaded, their fp32 copies and the product.
_swiglu_tuned = tuning.TunedKernel(
    _swiglu_kernel,
    tuple(TuneConfig({"BLOCK": b}, 5 * 4 * b) for b in (1024, 2048)),
    key=["N"],
    variants=(Variant({"CLAMP": 1}, (_swiglu_signature("*bf16"), _swiglu_signature("*fp32"))),),
)


def _combine_signature(shared: str, out: str) -> dict[str, str]:
    return {"y_ptr": "*fp32", "inv_ptr": "*i64", "kept_ptr": "*i32", "shared_ptr": shared, "out_ptr": out,
            "T": "i32", "K": "i32", "D": "i32"}  # fmt: skip


# Per column: the fp32 sum, one gathered row, the shared row and its fp32 copy, the output.
_COMBINE_CONFIGS = tuple(TuneConfig({"BLOCK_D": b}, 5 * 4 * b) for b in (512, 1024))
_combine_tuned = tuning.TunedKernel(
    _combine_kernel,
    _COMBINE_CONFIGS,
    key=["D"],
    name="combine",
    variants=(
        Variant({"SHARED": 0}, (_combine_signature("*fp32", "*bf16"), _combine_signature("*fp32", "*fp32"))),
        Variant({"SHARED": 1}, (_combine_signature("*bf16", "*fp32"), _combine_signature("*fp32", "*fp32"))),
    ),
)
KERNELS = (_route_tuned, _gate_up_tuned, _down_tuned, _swiglu_tuned, _combine_tuned)
