# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Float64 reference of the fused FP8 MoE, and input builders.

The reference follows the contract of ``vllm._hpc_ops.fused_moe_fp8``
directly, one local expert at a time:

* the input the kernel multiplies is FP8: given (``hidden_states`` FP8 with
  ``a1_scale``) or quantized from 16-bit ``hidden_states`` with the static
  per-tensor ``a1_scale``, per token (``amax / 448``, per-tensor mode with no
  ``a1_scale``) or per 1x128 group (``amax / 448``, block-wise mode);
* FP8 weights are dequantized with their per-expert or per-128x128-block
  scales;
* ``g, u = W13[e] @ x`` (gate rows first), ``h = silu(g) * u`` in float32,
  quantized to FP8 (``h / a2_scale`` per tensor, or per 1x128 group with
  ``amax / 448``) and dequantized;
* ``y = W2[e] @ h``; ``out[t] = sum_j w[t, j] * y_j (+ shared_output[t])``
  with ``w = 1`` under ``apply_router_weight_on_input``.

Quantization divides in float32 and saturates to +-448 (as vLLM's FP8
quantization does); an all-zero group or token gets scale 1. The GEMMs and
the reduction run in float64 (or the dtype asked for). So the reference uses
exactly the FP8 values the kernel should use, and a correct kernel differs
from it only by its float32 accumulation, its 16-bit rounding of each
expert's output and of ``out``, and the rare FP8 rounding flip of the
intermediate that those cause.

The builders make random FP8 weights with per-expert (per-tensor) or
per-block scales of varying magnitude, uniform, skewed or single-expert
routing, and expert parallelism as a contiguous local range
(``expert_offset``) or a scattered ``expert_map``.

This module imports torch only (and the error measures of ``utils``);
``moe_workspace`` imports the op module and its validation when called.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import torch

from tests.kernels.hpc.utils import ErrorStats, error_stats

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
FP8_NAN_BYTE = 0x7F

# Accuracy bars against the reference: ||out - ref|| / ||ref|| over the
# whole output, and per token row. A row may also differ by up to
# ROUNDING_NOISE_FACTOR times what rounding the intermediate to FP8 changes
# in the reference's own row: the kernel's fp32 tensor-core sums differ from
# float64 in the last bits, so an intermediate value next to an FP8 rounding
# boundary can round the other way, by one FP8 step (up to 12.5% of that
# value). With top-1 routing and I = 192, a token's output rests on 192 such
# values, and a few of those steps move the row by several percent.
RTOL = 3e-2
ROW_RTOL = 6e-2
ROUNDING_NOISE_FACTOR = 2.0

# Static scale of the intermediate in per-tensor mode. With the builders'
# magnitudes (gate and up of about unit variance), |silu(g) * u| stays far
# below 448 * A2_SCALE, so nothing saturates.
A2_SCALE = 0.15

ROUTINGS = ("uniform", "skewed", "single")
EP_MODES = ("none", "range", "map")
# Quantization modes of the tests: name -> (block-wise, FP8 hidden_states,
# static a1_scale for 16-bit hidden_states).
QUANT_MODES = {
    "tensor-static": (False, False, True),
    "tensor-dynamic": (False, False, False),
    "tensor-fp8": (False, True, True),
    "block": (True, False, False),
    "block-fp8": (True, True, False),
}


# ---------------------------------------------------------------------------
# Quantization helpers
# ---------------------------------------------------------------------------


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` in float32, saturated to +-448, rounded to E4M3."""
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device=x.device, dtype=torch.float32)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dynamic_scales(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """float32 ``amax / 448`` of each row (``group`` None: ``[rows, 1]``) or
    of each 1 x ``group`` slice of a row (``[rows, cols / group]``); 1 where
    the amax is 0."""
    x = x.float()
    if group is None:
        amax = x.abs().amax(dim=-1, keepdim=True)
    else:
        rows, cols = x.shape
        if cols % group:
            raise ValueError(f"{cols} columns are not a multiple of {group}")
        amax = x.reshape(rows, cols // group, group).abs().amax(dim=-1)
    # A tensor divisor: dividing by a Python scalar multiplies by its
    # rounded reciprocal, one ulp off the quotient now and then, which tips
    # the many exact rounding ties of x / scale (bf16 x, amax / 448).
    scale = amax / torch.full_like(amax, FP8_MAX)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def expand_scales(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast ``[rows / r, cols / c]`` block scales (or ``[rows, 1]``,
    or a one-element scale) to ``shape``."""
    rows, cols = shape
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, cols)
    if scale.dim() != 2:
        raise ValueError(f"block scales must be 2-D, got {tuple(scale.shape)}")
    rb = math.ceil(rows / scale.shape[0])
    cb = math.ceil(cols / scale.shape[1])
    full = scale.repeat_interleave(rb, dim=0).repeat_interleave(cb, dim=1)
    return full[:rows, :cols]


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * scale`` in ``dtype``, with ``scale`` expanded as by
    expand_scales (exact in float64: 4 significant bits times 24)."""
    full = expand_scales(scale, tuple(q.shape)).to(device=q.device, dtype=dtype)
    return q.to(dtype) * full


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-(1 x group) quantization: (FP8 values, ``[rows, cols /
    group]`` float32 scales)."""
    scale = dynamic_scales(x, group)
    return quantize_fp8(x, expand_scales(scale, tuple(x.shape))), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row quantization: (FP8 values, ``[rows, 1]`` scales)."""
    scale = dynamic_scales(x, None)
    return quantize_fp8(x, scale), scale


# ---------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------


def input_fp8(
    hidden_states: torch.Tensor,
    a1_scale: torch.Tensor | None,
    block_wise: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 input the kernel multiplies and its scales (broadcastable to
    ``[M, H]`` by expand_scales)."""
    if hidden_states.dtype == FP8_DTYPE:
        if a1_scale is None:
            raise ValueError("FP8 hidden_states need a1_scale")
        return hidden_states, a1_scale
    if block_wise:
        if a1_scale is not None:
            raise ValueError("block-wise 16-bit hidden_states take no a1_scale")
        return quantize_groups(hidden_states, BLOCK)
    if a1_scale is not None:
        return quantize_fp8(hidden_states, a1_scale), a1_scale
    return quantize_rows(hidden_states)


def dequantize_input(
    hidden_states: torch.Tensor,
    a1_scale: torch.Tensor | None,
    block_wise: bool,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[M, H]`` in ``dtype``: the FP8 input times its scales."""
    q, scale = input_fp8(hidden_states, a1_scale, block_wise)
    return dequantize(q, scale, dtype)


def dequantize_weight(
    w: torch.Tensor,
    scale: torch.Tensor,
    block_wise: bool,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Weights of one expert (``[N, K]``) in ``dtype`` from FP8 and the
    expert's scale (one element, or ``[N / 128, K / 128]``)."""
    if block_wise and scale.dim() != 2:
        raise ValueError(f"block scales must be 2-D, got {tuple(scale.shape)}")
    return dequantize(w, scale, dtype)


def quantize_intermediate(
    h: torch.Tensor,
    a2_scale: torch.Tensor | None,
    block_wise: bool,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``h`` (float32) after its FP8 round trip, in ``dtype``."""
    if block_wise:
        if a2_scale is not None:
            raise ValueError("block-wise mode takes no a2_scale")
        q, scale = quantize_groups(h, BLOCK)
    else:
        if a2_scale is None:
            raise ValueError("per-tensor mode needs a2_scale")
        q, scale = quantize_fp8(h, a2_scale), a2_scale
    return dequantize(q, scale, dtype)


def local_slots(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    expert_map: torch.Tensor | None = None,
    expert_offset: int = 0,
) -> torch.Tensor:
    """int64 ``[M, k]``: each choice's local expert slot, or -1 when the
    expert is not on this rank."""
    ids = topk_ids.long()
    if expert_map is not None:
        slots = expert_map.to(ids.device).long()[ids]
    else:
        slots = ids - expert_offset
    local = (slots >= 0) & (slots < num_local_experts)
    return torch.where(local, slots, torch.full_like(slots, -1))


def reference_fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | list[int] | None = None,
    expert_map: torch.Tensor | None = None,
    expert_offset: int = 0,
    shared_output: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    dtype: torch.dtype = torch.float64,
    round_intermediate: bool = True,
) -> torch.Tensor:
    """``[M, H]`` in ``dtype``: what ``fused_moe_fp8`` should write to
    ``out`` for the same arguments (before ``out``'s rounding).
    ``round_intermediate=False`` skips the intermediate's FP8 round trip
    (to measure what that rounding alone changes)."""
    block_wise = block_shape is not None
    if block_wise and tuple(block_shape) != (BLOCK, BLOCK):
        raise ValueError(f"block_shape must be ({BLOCK}, {BLOCK})")
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    device = hidden_states.device
    out = torch.zeros(num_tokens, hidden, dtype=dtype, device=device)
    if num_tokens == 0:
        return out
    x = dequantize_input(hidden_states, a1_scale, block_wise, dtype)
    slots = local_slots(topk_ids, num_experts, expert_map, expert_offset)
    weights = topk_weights.to(device=device, dtype=dtype)
    if apply_router_weight_on_input:
        weights = torch.ones_like(weights)
    for e in torch.unique(slots[slots >= 0]).tolist():
        tok, j = torch.nonzero(slots == e, as_tuple=True)
        w13e = dequantize_weight(w13[e], w13_scale[e], block_wise, dtype)
        w2e = dequantize_weight(w2[e], w2_scale[e], block_wise, dtype)
        gate_up = x[tok] @ w13e.T
        g, u = gate_up[:, :inter], gate_up[:, inter:]
        h = (g * torch.sigmoid(g) * u).float()
        if round_intermediate:
            h = quantize_intermediate(h, a2_scale, block_wise, dtype)
        else:
            h = h.to(dtype)
        y = h @ w2e.T
        out.index_add_(0, tok, y * weights[tok, j].unsqueeze(-1))
    if shared_output is not None:
        out += shared_output.to(dtype)
    return out


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class MoeWeights:
    """FP8 expert weights of one rank and their scales."""

    w13: torch.Tensor  # [E_local, 2I, H]
    w13_scale: torch.Tensor  # [E_local] or [E_local, 2I/128, H/128]
    w2: torch.Tensor  # [E_local, H, I]
    w2_scale: torch.Tensor  # [E_local] or [E_local, H/128, I/128]
    block_wise: bool

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]


def _fp8_matrix(
    rows: int,
    cols: int,
    std: float,
    block_wise: bool,
    gen: torch.Generator,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``[rows, cols]`` weights quantized like a checkpoint: one scale
    (``amax / 448``) or one per 128 x 128 block, whose magnitudes vary by up
    to 4x."""
    w = torch.randn(rows, cols, generator=gen, device=device) * std
    if not block_wise:
        scale = (w.abs().amax() / FP8_MAX).clamp_min(1e-12).reshape(())
        return quantize_fp8(w, scale), scale
    rb, cb = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
    spread = 0.5 + 1.5 * torch.rand(rb, cb, generator=gen, device=device)
    w = w * expand_scales(spread, (rows, cols))
    pad_r, pad_c = rb * BLOCK - rows, cb * BLOCK - cols
    padded = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
    amax = padded.reshape(rb, BLOCK, cb, BLOCK).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    return quantize_fp8(w, expand_scales(scale, (rows, cols))), scale


def make_moe_weights(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    block_wise: bool,
    seed: int = 0,
    device: torch.device | str = "cuda",
) -> MoeWeights:
    """Random FP8 weights. Each expert's weights have a standard deviation of
    0.5..1.5 over sqrt(fan-in), so gate and up are of about unit variance
    for unit-variance inputs, and the scales differ per expert (and per
    block)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    two_i = 2 * intermediate_size
    w13 = torch.empty(num_experts, two_i, hidden_size, dtype=FP8_DTYPE, device=device)
    w2 = torch.empty(
        num_experts, hidden_size, intermediate_size, dtype=FP8_DTYPE, device=device
    )
    s13, s2 = [], []
    mult = 0.5 + torch.rand(num_experts, 2, generator=gen, device=device)
    for e, (m13, m2) in enumerate(mult.tolist()):
        q, s = _fp8_matrix(
            two_i, hidden_size, m13 / math.sqrt(hidden_size), block_wise, gen, device
        )
        w13[e] = q
        s13.append(s)
        q, s = _fp8_matrix(
            hidden_size,
            intermediate_size,
            m2 / math.sqrt(intermediate_size),
            block_wise,
            gen,
            device,
        )
        w2[e] = q
        s2.append(s)
    return MoeWeights(
        w13=w13,
        w13_scale=torch.stack(s13).float().contiguous(),
        w2=w2,
        w2_scale=torch.stack(s2).float().contiguous(),
        block_wise=block_wise,
    )


def make_routing(
    num_tokens: int,
    num_global_experts: int,
    topk: int,
    *,
    routing: str = "uniform",
    ids_dtype: torch.dtype = torch.int32,
    gen: torch.Generator,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights float32 [M, k], topk_ids [M, k])``: k distinct global
    experts per token, weights a softmax over the chosen k.

    ``uniform``: every expert equally likely. ``skewed``: expert popularity
    falls off as rank^-1.5 over a random order, so a few experts take most
    tokens. ``single``: every token picks the same k experts.
    """
    if not 1 <= topk <= num_global_experts:
        raise ValueError(f"topk {topk} must be in 1..{num_global_experts}")
    if routing == "single":
        chosen = torch.randperm(num_global_experts, generator=gen, device=device)
        ids = chosen[:topk].expand(num_tokens, topk)
    elif routing == "uniform":
        keys = torch.rand(num_tokens, num_global_experts, generator=gen, device=device)
        ids = keys.topk(topk, dim=-1).indices
    elif routing == "skewed":
        order = torch.randperm(num_global_experts, generator=gen, device=device)
        ranks = torch.empty_like(order)
        ranks[order] = torch.arange(num_global_experts, device=device)
        probs = (ranks.double() + 1.0) ** -1.5
        probs = probs.expand(max(num_tokens, 1), -1).contiguous()
        ids = torch.multinomial(probs, topk, replacement=False, generator=gen)
        ids = ids[:num_tokens]
    else:
        raise ValueError(f"routing {routing!r}; accepted: {ROUTINGS}")
    logits = torch.randn(num_tokens, topk, generator=gen, device=device)
    weights = torch.softmax(logits, dim=-1).float().contiguous()
    return weights, ids.to(ids_dtype).contiguous()


def make_expert_map(
    num_global_experts: int,
    num_local_experts: int,
    *,
    gen: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """int32 ``[global_E]``: a random set of ``num_local_experts`` global
    experts, scattered over the id range, mapped to the local slots in a
    random order; -1 elsewhere."""
    chosen = torch.randperm(num_global_experts, generator=gen, device=device)
    chosen = chosen[:num_local_experts]
    expert_map = torch.full((num_global_experts,), -1, dtype=torch.int32, device=device)
    slots = torch.randperm(num_local_experts, generator=gen, device=device)
    expert_map[chosen] = slots.to(torch.int32)
    return expert_map


def _rows(values: torch.Tensor, dtype: torch.dtype, row_pad: int) -> torch.Tensor:
    """``values`` cast to ``dtype`` in a ``[M, H]`` view whose rows are
    ``row_pad`` elements longer than ``H`` (the padding holds NaN)."""
    m, h = values.shape
    if row_pad == 0:
        return values.to(dtype).contiguous()
    full = torch.empty(m, h + row_pad, dtype=dtype, device=values.device)
    if dtype == FP8_DTYPE:
        full.view(torch.uint8).fill_(FP8_NAN_BYTE)
    else:
        full.fill_(float("nan"))
    view = full[:, :h]
    view.copy_(values.to(dtype))
    return view


@dataclasses.dataclass
class MoeInputs:
    """Everything ``fused_moe_fp8`` takes, plus what built it."""

    weights: MoeWeights
    hidden_states: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    out: torch.Tensor
    a1_scale: torch.Tensor | None
    a2_scale: torch.Tensor | None
    expert_map: torch.Tensor | None
    expert_offset: int
    shared_output: torch.Tensor | None
    apply_router_weight_on_input: bool
    num_global_experts: int

    @property
    def num_tokens(self) -> int:
        return self.hidden_states.shape[0]

    @property
    def topk(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def block_shape(self) -> tuple[int, int] | None:
        return (BLOCK, BLOCK) if self.weights.block_wise else None

    def workspace_kwargs(self, max_tokens: int | None = None) -> dict[str, object]:
        """:func:`moe_workspace` (or ``MoeWorkspace.create``) arguments
        sized for these inputs."""
        return {
            "max_tokens": max_tokens or self.num_tokens,
            "topk": self.topk,
            "num_local_experts": self.weights.num_experts,
            "hidden_size": self.weights.hidden_size,
            "intermediate_size": self.weights.intermediate_size,
            "device": self.hidden_states.device,
        }

    def op_args(
        self,
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
    ]:
        """The positional arguments before the workspace."""
        return (
            self.hidden_states,
            self.weights.w13,
            self.weights.w2,
            self.topk_weights,
            self.topk_ids,
            self.out,
        )

    def op_kwargs(self) -> dict[str, object]:
        return {
            "w13_scale": self.weights.w13_scale,
            "w2_scale": self.weights.w2_scale,
            "a1_scale": self.a1_scale,
            "a2_scale": self.a2_scale,
            "block_shape": self.block_shape,
            "expert_map": self.expert_map,
            "expert_offset": self.expert_offset,
            "shared_output": self.shared_output,
            "apply_router_weight_on_input": self.apply_router_weight_on_input,
        }

    def reference(
        self, dtype: torch.dtype = torch.float64, round_intermediate: bool = True
    ) -> torch.Tensor:
        return reference_fused_moe(
            self.hidden_states,
            self.weights.w13,
            self.weights.w2,
            self.topk_weights,
            self.topk_ids,
            **self.op_kwargs(),  # type: ignore[arg-type]
            dtype=dtype,
            round_intermediate=round_intermediate,
        )

    def check(self, what: str = "") -> ErrorStats:
        """check_moe of ``out`` against the reference, each row's bar
        widened by the intermediate's own rounding noise in that row."""
        ref = self.reference()
        noise = row_rel_errors(ref, self.reference(round_intermediate=False))
        return check_moe(
            self.out,
            ref,
            unrouted=self.unrouted(),
            shared_output=self.shared_output,
            what=what,
            rounding_noise=noise,
        )

    def unrouted(self) -> torch.Tensor:
        """Tokens none of whose experts is local: bool ``[M]``."""
        slots = local_slots(
            self.topk_ids, self.weights.num_experts, self.expert_map, self.expert_offset
        )
        return (slots < 0).all(dim=-1)

    def poison_out(self) -> None:
        self.out.fill_(float("nan"))

    def input_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors the op reads besides the weights (by name)."""
        named = {
            "hidden_states": self.hidden_states,
            "topk_weights": self.topk_weights,
            "topk_ids": self.topk_ids,
            "a1_scale": self.a1_scale,
            "a2_scale": self.a2_scale,
            "expert_map": self.expert_map,
            "shared_output": self.shared_output,
        }
        return {k: v for k, v in named.items() if v is not None}

    def copy_into(self, other: MoeInputs) -> None:
        """Copy these inputs' activations, routing and scales into
        ``other``'s tensors (same shapes and weights: for CUDA-graph
        replays)."""
        if other.weights is not self.weights:
            raise ValueError("copy_into needs inputs built on the same weights")
        if other.expert_offset != self.expert_offset:
            raise ValueError("expert_offset differs")
        mine, theirs = self.input_tensors(), other.input_tensors()
        if mine.keys() != theirs.keys():
            raise ValueError(f"tensors {sorted(mine)} vs {sorted(theirs)}")
        for name, src in mine.items():
            dst = theirs[name]
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(
                    f"{name}: {tuple(dst.shape)} {dst.dtype} vs "
                    f"{tuple(src.shape)} {src.dtype}"
                )
            dst.copy_(src)


def make_moe_inputs(
    weights: MoeWeights,
    num_tokens: int,
    topk: int,
    *,
    hidden_dtype: torch.dtype = torch.bfloat16,
    out_dtype: torch.dtype | None = None,
    static_a1: bool = True,
    routing: str = "uniform",
    ep: str = "none",
    ep_size: int = 4,
    ep_rank: int = 1,
    ids_dtype: torch.dtype = torch.int32,
    shared_output: bool = False,
    apply_router_weight_on_input: bool = False,
    scalar_shape: tuple[int, ...] = (),
    row_pad: int = 0,
    seed: int = 0,
) -> MoeInputs:
    """Fresh random activations and routing for ``weights``.

    ``hidden_dtype``: bf16/fp16 (quantized by the kernel) or FP8 (quantized
    here: per tensor with ``a1_scale = amax / 448``, or per 1x128 group with
    ``[M, H/128]`` scales in block-wise mode). ``static_a1``: per-tensor mode
    with 16-bit inputs gets a static ``a1_scale`` (amax / 448), else None
    (per-token dynamic). ``out_dtype`` defaults to the 16-bit input dtype
    (bf16 for FP8 inputs).

    ``ep``: ``none`` (global ids = local slots), ``range`` (``ep_size`` x
    more global experts; this rank owns ``[ep_rank * E_local, (ep_rank + 1)
    * E_local)`` through ``expert_offset``) or ``map`` (``ep_size`` x more
    global experts, a scattered ``expert_map``).

    Hidden states are unit normal with one channel in 64 four times larger;
    ``shared_output`` (when asked for) is normal with std 0.5. ``row_pad``
    > 0 gives ``hidden_states``, ``out`` and ``shared_output`` rows that many
    elements longer than H. ``scalar_shape``: shape of the one-element
    scales, ``()`` or ``(1,)``. ``out`` holds NaN.
    """
    device = weights.w13.device
    gen = torch.Generator(device=device).manual_seed(seed)
    num_experts = weights.num_experts
    hidden = weights.hidden_size
    block_wise = weights.block_wise
    if out_dtype is None:
        out_dtype = torch.bfloat16 if hidden_dtype == FP8_DTYPE else hidden_dtype

    if ep == "none":
        num_global, expert_offset, expert_map = num_experts, 0, None
    elif ep == "range":
        num_global = num_experts * ep_size
        expert_offset, expert_map = ep_rank * num_experts, None
    elif ep == "map":
        num_global, expert_offset = num_experts * ep_size, 0
        expert_map = make_expert_map(num_global, num_experts, gen=gen, device=device)
    else:
        raise ValueError(f"ep {ep!r}; accepted: {EP_MODES}")
    topk_weights, topk_ids = make_routing(
        num_tokens,
        num_global,
        topk,
        routing=routing,
        ids_dtype=ids_dtype,
        gen=gen,
        device=device,
    )

    x = torch.randn(num_tokens, hidden, generator=gen, device=device)
    outliers = torch.ones(hidden, device=device)
    outliers[torch.randperm(hidden, generator=gen, device=device)[: hidden // 64]] = 4
    x = x * outliers
    a1_scale = None
    if hidden_dtype == FP8_DTYPE:
        if block_wise:
            q, a1_scale = quantize_groups(x, BLOCK)
        else:
            amax = x.abs().amax() if num_tokens else torch.ones((), device=device)
            a1_scale = (amax / FP8_MAX).clamp_min(1e-12).reshape(scalar_shape)
            q = quantize_fp8(x, a1_scale)
        hidden_states = _rows(q, FP8_DTYPE, row_pad)
    else:
        # Round to 16 bits first: the scale is the amax of what the kernel
        # reads.
        x = x.to(hidden_dtype)
        hidden_states = _rows(x, hidden_dtype, row_pad)
        if not block_wise and static_a1:
            amax = x.float().abs().amax() if num_tokens else torch.ones(())
            a1_scale = (amax / FP8_MAX).clamp_min(1e-12).reshape(scalar_shape)
            a1_scale = a1_scale.to(device)
    if a1_scale is not None:
        a1_scale = a1_scale.float().contiguous()
    a2_scale = None
    if not block_wise:
        a2_scale = torch.full(scalar_shape, A2_SCALE, device=device)

    shared = None
    if shared_output:
        values = 0.5 * torch.randn(num_tokens, hidden, generator=gen, device=device)
        shared = _rows(values, out_dtype, row_pad)
    out = _rows(
        torch.full((num_tokens, hidden), float("nan"), device=device),
        out_dtype,
        row_pad,
    )
    return MoeInputs(
        weights=weights,
        hidden_states=hidden_states,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        out=out,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
        expert_map=expert_map,
        expert_offset=expert_offset,
        shared_output=shared,
        apply_router_weight_on_input=apply_router_weight_on_input,
        num_global_experts=num_global,
    )


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def row_rel_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """float64 ``[M]``: ``||out_t - ref_t|| / ||ref_t||`` (the absolute
    norm where the reference row is 0)."""
    out, ref = out.double(), ref.double()
    num = torch.linalg.vector_norm(out - ref, dim=-1)
    den = torch.linalg.vector_norm(ref, dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), num)


def check_moe(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    unrouted: torch.Tensor,
    shared_output: torch.Tensor | None,
    what: str = "",
    rtol: float = RTOL,
    row_rtol: float = ROW_RTOL,
    rounding_noise: torch.Tensor | None = None,
) -> ErrorStats:
    """Fail unless ``out`` is finite, within ``rtol`` of ``ref`` overall and
    within ``row_rtol`` on every row (or ROUNDING_NOISE_FACTOR times the
    row's ``rounding_noise``, ``[M]``, where that is larger), and rows of
    tokens with no local expert are exactly ``shared_output`` (or zero)."""
    prefix = f"{what}: " if what else ""
    stats = error_stats(out, ref)
    assert stats.finite, f"{prefix}NaN or Inf in the output ({stats})"
    assert stats.rel <= rtol, f"{prefix}{stats} exceeds rtol={rtol:g}"
    rows = row_rel_errors(out, ref)
    if rows.numel():
        bars = torch.full_like(rows, row_rtol)
        if rounding_noise is not None:
            noise = rounding_noise.to(rows)
            bars = torch.maximum(bars, ROUNDING_NOISE_FACTOR * noise)
        worst = int((rows / bars).argmax())
        assert rows[worst] <= bars[worst], (
            f"{prefix}token {worst}: row error {rows[worst].item():.3e} exceeds "
            f"{bars[worst].item():.3e} (max of {row_rtol:g} and "
            f"{ROUNDING_NOISE_FACTOR:g} x the intermediate's rounding noise)"
        )
    idle = unrouted.to(out.device)
    if bool(idle.any()):
        got = out[idle]
        want = torch.zeros_like(got) if shared_output is None else shared_output[idle]
        assert torch.equal(got, want), (
            f"{prefix}{int(idle.sum())} tokens have no local expert: their rows "
            "must be exactly " + ("shared_output" if shared_output is not None else "0")
        )
    return stats


# ---------------------------------------------------------------------------
# Workspace
# ---------------------------------------------------------------------------


def moe_workspace(
    *,
    max_tokens: int,
    topk: int,
    num_local_experts: int,
    hidden_size: int,
    intermediate_size: int,
    device: torch.device | str,
) -> SimpleNamespace:
    """A workspace for ``fused_moe_fp8``: the fields the op reads of a
    ``MoeWorkspace``, with a zeroed buffer of the size the library asks for
    (``moe_workspace_bytes``). ``MoeWorkspace`` itself belongs to the vLLM
    layer (``hpc_moe``), and the kernel tests run without vLLM."""
    from vllm import _hpc_ops
    from vllm._hpc_ops_validation import validate_moe_workspace

    sizes = {
        "max_tokens": max_tokens,
        "topk": topk,
        "num_local_experts": num_local_experts,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
    }
    validate_moe_workspace(**sizes)
    nbytes = _hpc_ops.moe_workspace_bytes(**sizes)
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return SimpleNamespace(buffer=buffer, **sizes)
