# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Float32 reference of the fused attention prologue and input builders.

The reference follows the contract of ``vllm._hpc_ops.rope_norm_store_kv``
step by step (per-head RMSNorm, RoPE from vLLM's ``cos_sin_cache``, the
paged K/V cache write by slot, FP8 quantisation), one plain PyTorch function
per step. It runs on any device.

The builders produce inputs the way vLLM 0.33 lays them out: the
``cos_sin_cache`` of ``RotaryEmbedding`` and the KV cache of the HPC
attention backend, ``(num_blocks, Hkv, block_size, 2 * D)`` with the K and V
views ``kv.transpose(1, 2).split(D, -1)``, or the plain NHD cache
``(2, num_blocks, block_size, Hkv, D)``.

This module imports torch only (and the error measures of ``utils``).
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch

from tests.kernels.hpc.utils import ErrorStats, error_stats

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0

NORM_NONE = 0
NORM_ROPE_THEN_NORM = 1
NORM_NORM_THEN_ROPE = 2

# Every byte 0xFF is a NaN in bfloat16, float16, float32 and float8_e4m3fn,
# and no kernel computes that exact pattern, so it marks "never written".
POISON_BYTE = 0xFF


# ---------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (float64 stays)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return xf * inv_rms * weight.to(dtype)


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of ``x`` ([T, H, D]).

    ``cos_sin_cache`` is ``[max_position, rotary_dim]``: the cosines of the
    ``rotary_dim / 2`` frequencies, then their sines. NeoX style pairs
    channel ``i`` with ``i + rotary_dim / 2``; GPT-J style pairs ``2i`` with
    ``2i + 1``. Channels past ``rotary_dim`` pass through.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dtype)
    rotary_dim = cos_sin_cache.shape[-1]
    cos_sin = cos_sin_cache.index_select(0, positions.long()).to(dtype)
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim / 2]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        rot = torch.cat((o1, o2), dim=-1)
    else:
        rot = torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((rot, rest), dim=-1)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` saturated to the E4M3 range and rounded to FP8."""
    if isinstance(scale, torch.Tensor):
        scale = scale.float()
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` up to rounding."""
    if isinstance(scale, torch.Tensor):
        scale = scale.float()
    return x.float() * scale


def fp8_scales_per_row(x: torch.Tensor) -> torch.Tensor:
    """One scale per row of the last dim: ``amax / 448`` (q_scale[t, h])."""
    return x.float().abs().amax(dim=-1) / FP8_MAX


def quantize_fp8_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic FP8 quantisation; returns ``(x_fp8, scale)``.

    A row of zeros gets scale 0 and quantises to zeros.
    """
    scale = fp8_scales_per_row(x)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return quantize_fp8(x.float() / safe.unsqueeze(-1), 1.0), scale


# ---------------------------------------------------------------------------
# The whole prologue
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class PrologueReference:
    """Float32 results of the prologue, one row per token."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]


def reference_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_policy: int = NORM_NONE,
    is_neox: bool = True,
) -> PrologueReference:
    """Q, K after norm and RoPE and V, in float32, for every token of qkv."""
    num_tokens = qkv.shape[0]
    x = qkv.float()
    q_width = num_q_heads * head_size
    kv_width = num_kv_heads * head_size
    q = x[:, :q_width].reshape(num_tokens, num_q_heads, head_size)
    k = x[:, q_width : q_width + kv_width].reshape(num_tokens, num_kv_heads, head_size)
    v = x[:, q_width + kv_width : q_width + 2 * kv_width]
    v = v.reshape(num_tokens, num_kv_heads, head_size)
    positions = positions[:num_tokens]

    def norm(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q_norm_weight is None or k_norm_weight is None:
            raise ValueError("norm weights are required for a norm policy")
        return rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)

    def rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            apply_rope(q, positions, cos_sin_cache, is_neox),
            apply_rope(k, positions, cos_sin_cache, is_neox),
        )

    if norm_policy == NORM_NONE:
        q, k = rope(q, k)
    elif norm_policy == NORM_ROPE_THEN_NORM:
        q, k = norm(*rope(q, k))
    elif norm_policy == NORM_NORM_THEN_ROPE:
        q, k = rope(*norm(q, k))
    else:
        raise ValueError(f"unknown norm_policy {norm_policy}")
    return PrologueReference(q=q, k=k, v=v.clone())


# ---------------------------------------------------------------------------
# Paged KV cache: layouts, slot reads and writes
# ---------------------------------------------------------------------------


class KvLayout(str, enum.Enum):
    """How the K and V views sit in the cache tensor."""

    # vLLM 0.33 HPC_ATTN: (num_blocks, Hkv, block_size, 2 * D), K and V
    # interleaved in the last dim.
    HPC = "hpc"
    # Plain NHD: (2, num_blocks, block_size, Hkv, D).
    NHD = "nhd"


def kv_cache_shape(
    layout: KvLayout,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
) -> tuple[int, ...]:
    """Shape of the cache tensor of one layer in ``layout``."""
    if layout == KvLayout.HPC:
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def kv_views(
    kv_cache: torch.Tensor, layout: KvLayout, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[num_blocks, block_size, Hkv, D]`` K and V views of a cache."""
    if layout == KvLayout.HPC:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    else:
        key_cache, value_cache = kv_cache.unbind(0)
    return key_cache, value_cache


def _raw(t: torch.Tensor) -> torch.Tensor:
    """An integer view of the same bytes (for copies and bit compares)."""
    if t.element_size() == 1:
        return t.view(torch.uint8)
    if t.element_size() == 2:
        return t.view(torch.int16)
    return t.view(torch.int32)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` (contiguous) with NaN bytes (0xFF) in place."""
    t.view(torch.uint8).fill_(POISON_BYTE)
    return t


def is_poison(t: torch.Tensor) -> torch.Tensor:
    """Elementwise: does ``t`` still hold the poison bytes?"""
    raw = _raw(t)
    return raw == (POISON_BYTE if raw.dtype == torch.uint8 else -1)


def read_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``[n, Hkv, D]`` of a ``[num_blocks, block_size, Hkv, D]`` view."""
    block_size = cache.shape[1]
    slots = slots.long()
    return _raw(cache)[slots // block_size, slots % block_size].view(cache.dtype)


def write_slots(
    cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor
) -> None:
    """Write ``values[t]`` ([T, Hkv, D], cache dtype) at ``slot_mapping[t]``.

    Negative slots are padding and skipped, as the kernel does.
    """
    block_size = cache.shape[1]
    slots = slot_mapping[: values.shape[0]].long()
    valid = slots >= 0
    slots = slots[valid]
    _raw(cache)[slots // block_size, slots % block_size] = _raw(values[valid])


def written_mask(
    kv_cache: torch.Tensor,
    layout: KvLayout,
    head_size: int,
    slot_mapping: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """Bool tensor shaped like ``kv_cache``: True where the op writes."""
    mask = torch.zeros(kv_cache.shape, dtype=torch.bool, device=kv_cache.device)
    slots = slot_mapping[:num_tokens].long()
    slots = slots[slots >= 0]
    block_size = kv_views(mask, layout, head_size)[0].shape[1]
    for view in kv_views(mask, layout, head_size):
        view[slots // block_size, slots % block_size] = True
    return mask


# ---------------------------------------------------------------------------
# Error measures
# ---------------------------------------------------------------------------


def max_row_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ``||out - ref|| / ||ref||`` over the rows of the last dim."""
    if out.numel() == 0:
        return 0.0
    out = out.double()
    ref = ref.double()
    num = torch.linalg.vector_norm(out - ref, dim=-1)
    den = torch.linalg.vector_norm(ref, dim=-1).clamp_min(1e-30)
    return (num / den).max().item()


def assert_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    rtol: float,
    what: str,
    row_rtol: float | None = None,
) -> ErrorStats:
    """Fail unless ``out`` is finite and ``||out - ref|| / ||ref|| <= rtol``.

    With ``row_rtol``, every row (one head of one token) must also be within
    ``row_rtol``, so a few wrong rows cannot hide in a large tensor.
    """
    stats = error_stats(out, ref)
    assert stats.finite, f"{what}: NaN or Inf in the output ({stats})"
    assert stats.rel <= rtol, f"{what}: {stats} exceeds rtol={rtol:g}"
    if row_rtol is not None:
        worst = max_row_rel_error(out, ref)
        assert worst <= row_rtol, (
            f"{what}: worst row rel={worst:.3e} exceeds {row_rtol:g} ({stats})"
        )
    return stats


# ---------------------------------------------------------------------------
# vLLM-style inputs
# ---------------------------------------------------------------------------


def make_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``cos_sin_cache`` exactly as vLLM's ``RotaryEmbedding`` builds it."""
    inv_freq = 1.0 / (
        base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    )
    t = torch.arange(max_position, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return cache.to(dtype=dtype, device=device)


def make_slot_mapping(
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    num_padding: int,
    generator: torch.Generator,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Distinct random slots, with ``num_padding`` tokens set to -1."""
    num_slots = num_blocks * block_size
    if num_tokens > num_slots:
        raise ValueError(f"{num_tokens} tokens do not fit in {num_slots} slots")
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    if num_padding:
        pad = torch.randperm(num_tokens, generator=generator)[:num_padding]
        slots[pad] = -1
    return slots.to(dtype)


@dataclasses.dataclass
class PrologueInputs:
    """Everything ``rope_norm_store_kv`` takes, plus what built it."""

    qkv: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin_cache: torch.Tensor
    kv_cache: torch.Tensor  # the layer's cache tensor
    key_cache: torch.Tensor  # strided views of kv_cache
    value_cache: torch.Tensor
    q_out: torch.Tensor
    q_scale: torch.Tensor | None
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    eps: float
    norm_policy: int
    is_neox: bool
    layout: KvLayout
    num_q_heads: int
    num_kv_heads: int
    head_size: int

    @property
    def num_tokens(self) -> int:
        return self.qkv.shape[0]

    def op_args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.qkv,
            self.positions,
            self.slot_mapping,
            self.cos_sin_cache,
            self.key_cache,
            self.value_cache,
            self.q_out,
        )

    def op_kwargs(self) -> dict[str, object]:
        return {
            "q_scale": self.q_scale,
            "q_norm_weight": self.q_norm_weight,
            "k_norm_weight": self.k_norm_weight,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
            "eps": self.eps,
            "norm_policy": self.norm_policy,
            "is_neox": self.is_neox,
        }

    def reference(self) -> PrologueReference:
        return reference_prologue(
            self.qkv,
            self.positions,
            self.cos_sin_cache,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_size,
            q_norm_weight=self.q_norm_weight,
            k_norm_weight=self.k_norm_weight,
            eps=self.eps,
            norm_policy=self.norm_policy,
            is_neox=self.is_neox,
        )

    def poison_outputs(self) -> None:
        """NaN-fill q_out, q_scale and the whole KV cache."""
        poison_(self.q_out)
        poison_(self.kv_cache)
        if self.q_scale is not None:
            poison_(self.q_scale)


def make_prologue_inputs(
    *,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype | None = None,
    q_out_dtype: torch.dtype | None = None,
    rotary_dim: int | None = None,
    norm_policy: int = NORM_NONE,
    norm_weight_dtype: torch.dtype = torch.float32,
    is_neox: bool = True,
    layout: KvLayout = KvLayout.HPC,
    num_padding: int = 0,
    num_blocks: int | None = None,
    max_position: int = 8192,
    cos_sin_dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int64,
    qkv_row_padding: int = 0,
    kv_scale: float | None = None,
    eps: float = 1e-6,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> PrologueInputs:
    """Fresh random inputs in vLLM's layouts; outputs are NaN-poisoned.

    ``qkv_row_padding`` adds unused columns after each qkv row (a strided
    slice of a wider projection output). ``kv_scale`` defaults to a scale that
    maps the largest K/V magnitude the inputs can reach inside the E4M3 range.
    """
    cache_dtype = cache_dtype or dtype
    q_out_dtype = q_out_dtype or dtype
    rotary_dim = rotary_dim or head_size
    gen = torch.Generator().manual_seed(seed)
    width = (num_q_heads + 2 * num_kv_heads) * head_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    # A channel-dependent offset and scale, so the norm does visible work.
    channel = torch.linspace(0.5, 2.0, width)
    full = randn(num_tokens, width + qkv_row_padding)
    full[:, :width] = full[:, :width] * channel + 0.25
    qkv = full.to(dtype=dtype, device=device)[:, :width]

    positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
    if num_blocks is None:
        num_blocks = max(4, 2 * math.ceil(num_tokens / block_size))
    slot_mapping = make_slot_mapping(
        num_tokens, num_blocks, block_size, num_padding, gen, index_dtype
    )

    kv_cache = torch.empty(
        kv_cache_shape(layout, num_blocks, block_size, num_kv_heads, head_size),
        dtype=cache_dtype,
        device=device,
    )
    key_cache, value_cache = kv_views(kv_cache, layout, head_size)
    q_out = torch.empty(
        num_tokens, num_q_heads, head_size, dtype=q_out_dtype, device=device
    )
    q_scale = None
    if q_out_dtype == FP8_DTYPE:
        q_scale = torch.empty(
            num_tokens, num_q_heads, dtype=torch.float32, device=device
        )

    q_norm_weight = k_norm_weight = None
    if norm_policy != NORM_NONE:
        q_norm_weight = (torch.rand(head_size, generator=gen) * 1.5 + 0.25).to(
            dtype=norm_weight_dtype, device=device
        )
        k_norm_weight = (torch.rand(head_size, generator=gen) * 1.5 + 0.25).to(
            dtype=norm_weight_dtype, device=device
        )

    inputs = PrologueInputs(
        qkv=qkv,
        positions=positions.to(dtype=index_dtype, device=device),
        slot_mapping=slot_mapping.to(device),
        cos_sin_cache=make_cos_sin_cache(
            rotary_dim, max_position, dtype=cos_sin_dtype, device=device
        ),
        kv_cache=kv_cache,
        key_cache=key_cache,
        value_cache=value_cache,
        q_out=q_out,
        q_scale=q_scale,
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
        k_scale=None,
        v_scale=None,
        eps=eps,
        norm_policy=norm_policy,
        is_neox=is_neox,
        layout=layout,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
    )
    if cache_dtype == FP8_DTYPE:
        if kv_scale is None:
            # Twice the largest magnitude these inputs produce fits the E4M3
            # range, so fresh inputs of the same kind do not saturate either.
            ref = inputs.reference()
            amax = torch.maximum(ref.k.abs().amax(), ref.v.abs().amax()).item()
            kv_scale = 2.0 * amax / FP8_MAX
        inputs.k_scale = torch.tensor([kv_scale], dtype=torch.float32, device=device)
        inputs.v_scale = torch.tensor(
            [kv_scale * 0.75], dtype=torch.float32, device=device
        )
    inputs.poison_outputs()
    return inputs


def expected_cache(inputs: PrologueInputs, ref: PrologueReference) -> torch.Tensor:
    """The KV cache tensor after the op: poison everywhere but written slots."""
    kv = poison_(torch.empty_like(inputs.kv_cache))
    key_cache, value_cache = kv_views(kv, inputs.layout, inputs.head_size)
    if kv.dtype == FP8_DTYPE:
        k = quantize_fp8(ref.k, inputs.k_scale)
        v = quantize_fp8(ref.v, inputs.v_scale)
    else:
        k, v = ref.k.to(kv.dtype), ref.v.to(kv.dtype)
    write_slots(key_cache, inputs.slot_mapping, k)
    write_slots(value_cache, inputs.slot_mapping, v)
    return kv


# Accuracy bars. bf16/fp16 outputs: 1e-2. FP8 outputs, dequantized: 3e-2
# against the float32 reference (E4M3 rounding alone costs about 2.6e-2 on
# Gaussian data), and 2e-2 against the reference quantized with the same
# scale, which only differs where the two straddle a rounding boundary.
# Per-row bars bound each head of each token.
RTOL = 1e-2
ROW_RTOL = 2e-2
FP8_RTOL = 3e-2
FP8_ROW_RTOL = 8e-2
FP8_SAME_SCALE_RTOL = 2e-2
Q_SCALE_RTOL = 1e-2


def _check_fp8(
    got: torch.Tensor,
    scale: torch.Tensor,
    ref: torch.Tensor,
    what: str,
    stats: dict[str, ErrorStats],
    name: str,
) -> None:
    """FP8 ``got`` with (broadcastable) ``scale`` against float32 ``ref``."""
    deq = dequantize_fp8(got, scale)
    stats[name] = assert_close(deq, ref, FP8_RTOL, what, FP8_ROW_RTOL)
    same = dequantize_fp8(quantize_fp8(ref, scale), scale)
    stats[f"{name}_vs_quantized_ref"] = assert_close(
        deq, same, FP8_SAME_SCALE_RTOL, f"{what} vs the quantized reference"
    )


def check_outputs(
    inputs: PrologueInputs,
    qkv_before: torch.Tensor,
    what: str = "",
) -> dict[str, ErrorStats]:
    """Check every output of one call against the reference.

    * ``qkv`` is left as it was;
    * every element of ``q_out`` (and ``q_scale``) is written, finite and
      close to the reference; FP8 Q is compared dequantized, and its scales
      against ``amax / 448`` of the reference;
    * K and V at every valid slot are close to the reference (FP8:
      dequantized); V in a model-dtype cache is bit-exact;
    * every other element of the cache tensor still holds the poison.

    Returns the error statistics by output name.
    """
    prefix = f"{what}: " if what else ""
    assert torch.equal(_raw(inputs.qkv), _raw(qkv_before)), f"{prefix}qkv changed"
    ref = inputs.reference()
    stats: dict[str, ErrorStats] = {}

    if inputs.q_out.dtype == FP8_DTYPE:
        assert inputs.q_scale is not None
        q_scale = inputs.q_scale[: inputs.num_tokens]
        ref_scale = fp8_scales_per_row(ref.q)
        assert torch.isfinite(q_scale).all(), f"{prefix}q_scale not finite"
        worst = ((q_scale - ref_scale).abs() / ref_scale.clamp_min(1e-30)).max()
        assert worst.item() <= Q_SCALE_RTOL, (
            f"{prefix}q_scale: worst rel error {worst.item():.3e}"
        )
        stats["q_scale"] = error_stats(q_scale, ref_scale)
        _check_fp8(inputs.q_out, q_scale.unsqueeze(-1), ref.q, f"{prefix}q", stats, "q")
    else:
        stats["q"] = assert_close(
            inputs.q_out.float(), ref.q, RTOL, f"{prefix}q", ROW_RTOL
        )

    mask = written_mask(
        inputs.kv_cache,
        inputs.layout,
        inputs.head_size,
        inputs.slot_mapping,
        inputs.num_tokens,
    )
    untouched = is_poison(inputs.kv_cache)[~mask]
    assert untouched.all(), (
        f"{prefix}{int((~untouched).sum())} cache elements outside the valid "
        "slots were overwritten"
    )
    slot_mapping = inputs.slot_mapping[: inputs.num_tokens]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k = read_slots(inputs.key_cache, slots)
    v = read_slots(inputs.value_cache, slots)
    if inputs.kv_cache.dtype == FP8_DTYPE:
        assert inputs.k_scale is not None and inputs.v_scale is not None
        _check_fp8(k, inputs.k_scale, ref.k[valid], f"{prefix}k", stats, "k")
        _check_fp8(v, inputs.v_scale, ref.v[valid], f"{prefix}v", stats, "v")
    else:
        stats["k"] = assert_close(k.float(), ref.k[valid], RTOL, f"{prefix}k", ROW_RTOL)
        expect_v = ref.v[valid].to(v.dtype)
        assert torch.equal(_raw(v), _raw(expect_v)), (
            f"{prefix}v is not a bit-exact copy"
        )
        stats["v"] = error_stats(v.float(), ref.v[valid])
    return stats
