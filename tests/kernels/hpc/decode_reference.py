# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Float64 reference of split-KV paged decode attention, and input builders.

The reference follows the contract of ``vllm._hpc_ops.decode_attention``
directly, one sequence at a time, with no split, no tiling and no online
softmax: it gathers the sequence's K and V through the block table,
dequantizes FP8 (``x8.float() * scale``), applies the causal and
sliding-window masks and the soft-cap, and takes the softmax in float64. A
query row that sees no key gets zeros.

The builders lay the KV cache out three ways (two separate tensors, vLLM's
stacked ``(num_blocks, 2, block_size, Hkv, D)`` tensor, and the HPC backend's
``(num_blocks, Hkv, block_size, 2 * D)`` tensor), shuffle the blocks through
the block table, and fill every cache element a kernel must never read
(unused blocks, slots past each sequence's length) with NaN.

This module imports torch only (and the shared helpers of ``utils``); the
plan functions at the end import the op module when called.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tests.kernels.hpc.utils import (
    FP8_DTYPE,
    CacheLayout,
    ErrorStats,
    error_stats,
    raw_view,
)

FP8_MAX = 448.0
# 0x7F is NaN in float8_e4m3fn (the format has no infinities).
FP8_NAN_BYTE = 0x7F

# Accuracy bars: ||out - ref|| / ||ref|| over the whole output and over each
# sequence's rows, and the largest absolute error. The FP8 bars are looser
# although the reference uses the same dequantized values: the kernel may
# round queries and probabilities to fp16 for the FP8 MMA path. With P
# rounded to E4M3 (the FP8 tensor-core path), against the exact-P
# reference, the FP8_P bars.
RTOL = 1e-2
FP8_RTOL = 3e-2
FP8_P_RTOL = 5e-2
ATOL = 4e-2
FP8_ATOL = 8e-2
FP8_P_ATOL = 1.5e-1


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def poison_cache_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN in place (FP8: the NaN byte 0x7F)."""
    if t.dtype == FP8_DTYPE:
        t.view(torch.uint8).fill_(FP8_NAN_BYTE)
    else:
        t.fill_(float("nan"))
    return t


def to_float64(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` in float64, times ``scale`` (broadcast) when given. FP8 goes
    through float32, which holds every E4M3 value exactly."""
    x64 = x.to(torch.float32).to(torch.float64)
    if scale is not None:
        x64 = x64 * scale.to(device=x.device, dtype=torch.float64)
    return x64


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to the E4M3 range (never NaN for finite x)."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def default_dtypes(
    kv_dtype: torch.dtype,
    q_dtype: torch.dtype | None,
    out_dtype: torch.dtype | None,
    scale: float | None,
    head_size: int,
) -> tuple[torch.dtype, torch.dtype, float]:
    """``(q_dtype, out_dtype, scale)`` with the builders' defaults: the
    query dtype is the cache's (bf16 for an FP8 cache), the output dtype the
    query's (bf16 for FP8 queries), the scale ``1 / sqrt(head_size)``."""
    if q_dtype is None:
        q_dtype = torch.bfloat16 if kv_dtype == FP8_DTYPE else kv_dtype
    if out_dtype is None:
        out_dtype = torch.bfloat16 if q_dtype == FP8_DTYPE else q_dtype
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    return q_dtype, out_dtype, scale


def quantize_queries(q_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 queries and their per-(token, head) scales ``amax / 448``."""
    q_scale = (q_full.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)
    return quantize_fp8(q_full, q_scale.unsqueeze(-1)), q_scale


def check_whole(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    fp8: bool,
    prefix: str,
    fp8_p: bool = False,
) -> tuple[ErrorStats, float]:
    """Fail unless ``out`` is finite and within the relative and absolute
    bars of ``ref`` over the whole output (the FP8_P bars where ``fp8_p``:
    probabilities rounded to E4M3); its error stats and the relative bar
    (for the per-sequence checks)."""
    if fp8_p:
        rtol, atol = FP8_P_RTOL, FP8_P_ATOL
    else:
        rtol, atol = (FP8_RTOL, FP8_ATOL) if fp8 else (RTOL, ATOL)
    stats = error_stats(out, ref)
    assert stats.finite, f"{prefix}NaN or Inf in the output ({stats})"
    assert stats.rel <= rtol, f"{prefix}{stats} exceeds rtol={rtol:g}"
    assert stats.max_abs <= atol, f"{prefix}{stats} exceeds atol={atol:g}"
    return stats, rtol


def gather_sequence(
    cache: torch.Tensor, block_row: torch.Tensor, length: int
) -> torch.Tensor:
    """The first ``length`` tokens ``[length, Hkv, D]`` of one sequence, read
    from a ``[num_blocks, block_size, Hkv, D]`` view through its block-table
    row."""
    _, block_size, num_kv_heads, head_size = cache.shape
    num_blocks = math.ceil(length / block_size)
    ids = block_row[:num_blocks].to(device=cache.device, dtype=torch.long)
    blocks = raw_view(cache).index_select(0, ids).view(cache.dtype)
    return blocks.reshape(-1, num_kv_heads, head_size)[:length]


# ---------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------


def reference_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor | list[int],
    *,
    scale: float,
    query_tokens: int = 1,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:
    """Decode attention in float64, ``[batch * query_tokens, Hq, D]``.

    Query ``t`` of a sequence of length ``L`` sits at position
    ``p = L - query_tokens + t`` and sees the keys at positions ``<= p``, and
    with a window ``w > 0`` only those in ``(p - w, p]``. Logits are
    ``scale * q.k``, soft-capped as ``c * tanh(logits / c)`` when ``c > 0``.
    """
    lens = kv_lens.tolist() if isinstance(kv_lens, torch.Tensor) else list(kv_lens)
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    tokens, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    if tokens != len(lens) * query_tokens:
        raise ValueError(f"q has {tokens} rows for {len(lens)} sequences")
    q64 = to_float64(q, None if q_scale is None else q_scale.unsqueeze(-1))
    out = torch.zeros(
        tokens, num_q_heads, head_size, dtype=torch.float64, device=q.device
    )
    for b, length in enumerate(lens):
        if length <= 0:
            continue
        rows = slice(b * query_tokens, (b + 1) * query_tokens)
        k = to_float64(gather_sequence(key_cache, block_table[b], length), k_scale)
        v = to_float64(gather_sequence(value_cache, block_table[b], length), v_scale)
        k, v = k.to(q.device), v.to(q.device)
        qs = q64[rows].reshape(query_tokens, num_kv_heads, group, head_size)
        logits = torch.einsum("tkgd,lkd->tkgl", qs, k) * scale
        if softcap > 0.0:
            logits = softcap * torch.tanh(logits / softcap)
        pos = length - query_tokens + torch.arange(query_tokens, device=q.device)
        keys = torch.arange(length, device=q.device)
        visible = keys[None, :] <= pos[:, None]
        if window > 0:
            visible &= keys[None, :] > pos[:, None] - window
        logits = logits.masked_fill(~visible[:, None, None, :], -math.inf)
        row_max = logits.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
        probs = torch.exp(logits - row_max)
        denom = probs.sum(dim=-1, keepdim=True)
        probs = probs / torch.where(denom > 0, denom, 1.0)
        o = torch.einsum("tkgl,lkd->tkgd", probs, v)
        out[rows] = o.reshape(query_tokens, num_q_heads, head_size)
    return out


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def make_kv_cache(
    layout: CacheLayout,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """``(storage tensors, key_cache view, value_cache view)``."""
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    if layout == CacheLayout.SEPARATE:
        k = torch.empty(shape, dtype=dtype, device=device)
        v = torch.empty(shape, dtype=dtype, device=device)
        return (k, v), k, v
    if layout == CacheLayout.STACKED:
        kv = torch.empty(
            num_blocks,
            2,
            block_size,
            num_kv_heads,
            head_size,
            dtype=dtype,
            device=device,
        )
        return (kv,), kv[:, 0], kv[:, 1]
    kv = torch.empty(
        num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype, device=device
    )
    key_cache = kv[..., :head_size].permute(0, 2, 1, 3)
    value_cache = kv[..., head_size:].permute(0, 2, 1, 3)
    return (kv,), key_cache, value_cache


class PagedInputs:
    """What the decode and prefill inputs share: the sizes read off their
    tensors, the NaN output and the copy into another set of inputs."""

    lens: list
    q: torch.Tensor
    q_scale: torch.Tensor | None
    key_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    out: torch.Tensor

    @property
    def batch(self) -> int:
        return len(self.lens)

    @property
    def num_q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[2]

    @property
    def fp8(self) -> bool:
        """FP8 anywhere (cache or queries): the looser accuracy bars."""
        return FP8_DTYPE in (self.key_cache.dtype, self.q.dtype)

    def poison_out(self) -> None:
        self.out.fill_(float("nan"))

    def copy_tensors_into(
        self,
        other: PagedInputs,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Copy ``(dst, src)`` ``pairs`` and the scales into ``other``'s
        tensors (same shapes and dtypes); ``other.lens`` follows."""
        for name in ("q_scale", "k_scale", "v_scale"):
            dst, src = getattr(other, name), getattr(self, name)
            if (dst is None) != (src is None):
                raise ValueError(f"{name} is set on one side only")
            if dst is not None:
                pairs.append((dst, src))
        for dst, src in pairs:
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(
                    f"shape/dtype mismatch: {tuple(dst.shape)} {dst.dtype} vs "
                    f"{tuple(src.shape)} {src.dtype}"
                )
            raw_view(dst).copy_(raw_view(src))
        other.lens = list(self.lens)


@dataclasses.dataclass
class DecodeInputs(PagedInputs):
    """Everything ``decode_attention`` takes, plus what built it."""

    lens: list[int]
    q: torch.Tensor
    q_scale: torch.Tensor | None
    storage: tuple[torch.Tensor, ...]  # tensors that hold the K/V views
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    kv_lens: torch.Tensor
    out: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scale: float
    softcap: float
    window: int
    query_tokens: int
    layout: CacheLayout

    @property
    def head_size(self) -> int:
        return self.key_cache.shape[3]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    def workspace_kwargs(self) -> dict[str, object]:
        """``DecodeWorkspace.create`` arguments sized for these inputs."""
        return {
            "max_batch": self.batch,
            "num_q_heads": self.num_q_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "max_kv_tokens": self.num_blocks * self.block_size,
            "device": self.q.device,
            "max_query_tokens": self.query_tokens,
            "kv_cache_dtype": self.key_cache.dtype,
            "window": self.window,
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
        """The op's positional arguments before the workspace."""
        return (
            self.q,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.kv_lens,
            self.out,
        )

    def op_kwargs(self) -> dict[str, object]:
        return {
            "scale": self.scale,
            "query_tokens": self.query_tokens,
            "q_scale": self.q_scale,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
            "softcap": self.softcap,
        }

    def reference(self) -> torch.Tensor:
        """The reference of these inputs, with the op's keyword arguments
        and the workspace's window."""
        return reference_decode(
            self.q,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.lens,
            **self.op_kwargs(),  # type: ignore[arg-type]
            window=self.window,
        )

    def check(self, what: str = "") -> ErrorStats:
        """``out`` against the reference (``check_decode``)."""
        return check_decode(
            self.out,
            self.reference(),
            self.lens,
            self.query_tokens,
            fp8=self.fp8,
            what=what,
        )

    def copy_into(self, other: DecodeInputs) -> None:
        """Copy these inputs' contents into ``other``'s tensors (same shapes:
        for CUDA-graph replays). ``other.lens`` follows."""
        pairs = [
            (other.q, self.q),
            (other.block_table, self.block_table),
            (other.kv_lens, self.kv_lens),
            *zip(other.storage, self.storage, strict=True),
        ]
        self.copy_tensors_into(other, pairs)


def make_decode_inputs(
    lens: list[int] | tuple[int, ...],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    kv_dtype: torch.dtype = torch.bfloat16,
    q_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    query_tokens: int = 1,
    layout: CacheLayout = CacheLayout.SEPARATE,
    scale: float | None = None,
    softcap: float = 0.0,
    window: int = 0,
    num_blocks: int | None = None,
    max_blocks: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cuda",
) -> DecodeInputs:
    """Fresh random inputs for ``lens`` (KV lengths including the queries).

    ``q_dtype`` defaults to the cache dtype (bf16 for an FP8 cache),
    ``out_dtype`` to the query dtype (bf16 for FP8 queries), ``scale`` to
    ``1 / sqrt(head_size)``. The cache gets ``num_blocks`` blocks (default:
    those the sequences need plus about an eighth spare), dealt to the
    sequences in a random order; block-table entries past a sequence's
    blocks name spare blocks. Unused blocks and the slots past each
    sequence's length hold NaN; ``out`` holds NaN.
    """
    lens = [int(n) for n in lens]
    if any(0 < n < query_tokens for n in lens):
        raise ValueError(f"a non-empty sequence is shorter than {query_tokens} queries")
    device = torch.device(device)
    q_dtype, out_dtype, scale = default_dtypes(
        kv_dtype, q_dtype, out_dtype, scale, head_size
    )
    host_gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=dev_gen, device=device)

    # Blocks: a random permutation, dealt in order; spares fill the rest.
    blocks_needed = [math.ceil(n / block_size) for n in lens]
    used = sum(blocks_needed)
    if num_blocks is None:
        num_blocks = used + max(2, used // 8)
    if max_blocks is None:
        max_blocks = max(blocks_needed, default=0) + 1
    if used > num_blocks or max(blocks_needed, default=0) > max_blocks:
        raise ValueError("the cache or the block table is too small for lens")
    perm = torch.randperm(num_blocks, generator=host_gen)
    spare = perm[used:] if used < num_blocks else perm
    fill = torch.randint(0, spare.numel(), (len(lens), max_blocks), generator=host_gen)
    table = spare[fill]
    offset = 0
    for b, count in enumerate(blocks_needed):
        table[b, :count] = perm[offset : offset + count]
        offset += count

    # Every valid (block, slot) of every sequence, in sequence order.
    blk_parts, slot_parts = [], []
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        blk_parts.append(table[b, pos // block_size])
        slot_parts.append(pos % block_size)
    blk = torch.cat(blk_parts).to(device) if lens else torch.zeros(0, dtype=torch.long)
    slot = (
        torch.cat(slot_parts).to(device) if lens else torch.zeros(0, dtype=torch.long)
    )
    total = blk.numel()

    storage, key_cache, value_cache = make_kv_cache(
        layout, num_blocks, block_size, num_kv_heads, head_size, kv_dtype, device
    )
    for t in storage:
        poison_cache_(t)
    k_vals = randn(total, num_kv_heads, head_size)
    v_vals = randn(total, num_kv_heads, head_size)
    k_scale = v_scale = None
    if kv_dtype == FP8_DTYPE:
        # Per-tensor scales that map the largest magnitude near the top of
        # the E4M3 range, as a calibrated cache would.
        k_amax = k_vals.abs().amax() if total else torch.ones((), device=device)
        v_amax = v_vals.abs().amax() if total else torch.ones((), device=device)
        k_scale = (k_amax / (0.9 * FP8_MAX)).float().reshape(1)
        v_scale = (v_amax / (0.9 * FP8_MAX)).float().reshape(1)
        k_vals = quantize_fp8(k_vals, k_scale)
        v_vals = quantize_fp8(v_vals, v_scale)
    else:
        k_vals, v_vals = k_vals.to(kv_dtype), v_vals.to(kv_dtype)
    raw_view(key_cache)[blk, slot] = raw_view(k_vals)
    raw_view(value_cache)[blk, slot] = raw_view(v_vals)

    tokens = len(lens) * query_tokens
    q_full = randn(tokens, num_q_heads, head_size)
    q_scale = None
    if q_dtype == FP8_DTYPE:
        q, q_scale = quantize_queries(q_full)
    else:
        q = q_full.to(q_dtype)
    out = torch.full(
        (tokens, num_q_heads, head_size), float("nan"), dtype=out_dtype, device=device
    )
    return DecodeInputs(
        lens=lens,
        q=q,
        q_scale=q_scale,
        storage=storage,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=table.to(dtype=torch.int32, device=device),
        kv_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        out=out,
        k_scale=k_scale,
        v_scale=v_scale,
        scale=float(scale),
        softcap=float(softcap),
        window=int(window),
        query_tokens=query_tokens,
        layout=layout,
    )


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def check_decode(
    out: torch.Tensor,
    ref: torch.Tensor,
    lens: list[int],
    query_tokens: int,
    *,
    fp8: bool,
    what: str = "",
) -> ErrorStats:
    """Fail unless ``out`` is finite and close to ``ref``: relative error
    over the whole output and over each sequence's rows, and the largest
    absolute error. Sequences of length 0 must be exactly zero."""
    prefix = f"{what}: " if what else ""
    stats, rtol = check_whole(out, ref, fp8=fp8, prefix=prefix)
    for b, length in enumerate(lens):
        rows = slice(b * query_tokens, (b + 1) * query_tokens)
        if length <= 0:
            assert bool((out[rows] == 0).all()), (
                f"{prefix}sequence {b} has no KV but its output is not zero"
            )
            continue
        seq = error_stats(out[rows], ref[rows])
        assert seq.rel <= rtol, (
            f"{prefix}sequence {b} (length {length}): {seq} exceeds rtol={rtol:g}"
        )
    return stats


# ---------------------------------------------------------------------------
# Plans: the host planner and a reader (they need the op module and the
# library, imported when called)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Views of a decode plan copied to the host."""

    num_units: int
    total_granules: int
    num_ctas: int
    num_partials: int
    split_tiles: int
    query_tokens: int
    mode: int
    window: int
    unit_granule_offset: torch.Tensor  # [num_units + 1]
    unit_num_pieces: torch.Tensor  # [num_units]
    unit_first_partial: torch.Tensor  # [num_units], -1: written directly
    cta_granule_begin: torch.Tensor  # [num_ctas + 1]
    cta_first_unit: torch.Tensor  # [num_ctas]
    # [max_ctas, words]: every CTA slot's first work item, resolved as the
    # kernel's cursor does, columns named by decode_item_fields(); unit -1
    # for a slot without work.
    cta_first_item: torch.Tensor


def decode_item_fields() -> tuple[str, ...]:
    """Columns of DecodePlan.cta_first_item, asked of the library
    (decode_plan.h CtaItemField)."""
    return tuple(torch.ops._hpc_C.decode_plan_item_fields())


def decode_plan_of(plan: torch.Tensor, max_units: int, max_ctas: int) -> DecodePlan:
    """The plan in buffer ``plan`` (laid out for ``max_units`` units and
    ``max_ctas`` CTA slots), copied to the host (synchronises). The arrays'
    offsets come from the library (``decode_plan_layout``)."""
    from vllm import _hpc_ops as ops

    plan = plan.cpu()
    layout = ops.decode_plan_layout(max_units, max_ctas)
    header_size = layout["header"]
    o_offset, o_pieces, o_partial = (
        layout["unit_granule_offset"],
        layout["unit_num_pieces"],
        layout["unit_first_partial"],
    )
    o_begin, o_first, o_item = (
        layout["cta_granule_begin"],
        layout["cta_first_unit"],
        layout["cta_first_item"],
    )
    words = len(decode_item_fields())
    names = list(torch.ops._hpc_C.decode_plan_header_fields())
    header = dict(zip(names, map(int, plan[: len(names)].tolist()), strict=True))
    assert len(names) <= header_size
    units, ctas = header["num_units"], header["num_ctas"]
    return DecodePlan(
        **header,
        unit_granule_offset=plan[o_offset : o_offset + units + 1],
        unit_num_pieces=plan[o_pieces : o_pieces + units],
        unit_first_partial=plan[o_partial : o_partial + units],
        cta_granule_begin=plan[o_begin : o_begin + ctas + 1],
        cta_first_unit=plan[o_first : o_first + ctas],
        cta_first_item=plan[o_item : o_item + max_ctas * words].view(max_ctas, words),
    )


def read_decode_plan(workspace) -> DecodePlan:
    """The current plan of a ``DecodeWorkspace``, copied to the host."""
    return decode_plan_of(
        workspace.plan_buffer, workspace.max_units, workspace.max_ctas
    )


def plan_decode_host(
    kv_lens: torch.Tensor,
    num_kv_heads: int,
    query_tokens: int,
    num_ctas: int,
    *,
    min_split_len: int = 256,
    fixed_split_len: int = 0,
    max_batch: int | None = None,
    window: int = 0,
    mode=None,
    group: int = 1,
    kv_element_bytes: int = 2,
) -> torch.Tensor:
    """Split-KV decode plan for KV lengths held on the host (the host
    planner, which writes what the GPU planner does, bit for bit).

    ``kv_lens``: int32 ``[batch]`` on the CPU. ``num_ctas``: persistent CTAs
    offered (e.g. the SM count). ``min_split_len`` (tokens): the balanced
    mode uses no more CTAs than keep this many tokens each.
    ``fixed_split_len`` > 0 selects the batch-invariant mode with pieces of
    that many tokens unless ``mode`` (a ``SplitMode``) says otherwise.
    ``window``: sliding window in tokens (0: none); tiles no query can see
    are not planned. ``group`` (query heads per KV head) and
    ``kv_element_bytes`` weigh the balanced mode's merges (the planner's
    merge_bound_tiles). Returns the int32 plan for ``max_batch * num_kv_heads``
    units and the mode's CTA slots (the static mode has ``max_batch *
    num_kv_heads * 16``); read it with :func:`decode_plan_of`.
    """
    from vllm import _hpc_ops as ops
    from vllm._hpc_ops_validation import validate_query_tokens, validate_split_mode

    if (
        not isinstance(kv_lens, torch.Tensor)
        or kv_lens.dim() != 1
        or kv_lens.dtype != torch.int32
    ):
        raise ValueError(f"kv_lens must be an int32 [batch] tensor, got {kv_lens!r}")
    for name, value in (("num_kv_heads", num_kv_heads), ("num_ctas", num_ctas)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    validate_query_tokens(query_tokens)
    mode = validate_split_mode(
        mode, min_split_len=min_split_len, fixed_split_len=fixed_split_len
    )
    if window < 0:
        raise ValueError(f"window is {window}; accepted: 0 (none) or a positive int")
    if kv_lens.device.type != "cpu":
        raise ValueError(f"kv_lens must be on the CPU, got {kv_lens.device}")
    batch = kv_lens.shape[0] if max_batch is None else max_batch
    if batch < kv_lens.shape[0]:
        raise ValueError(f"max_batch {batch} < len(kv_lens) {kv_lens.shape[0]}")
    max_units = batch * num_kv_heads
    max_ctas, _ = ops.decode_workspace_sizes(
        mode,
        batch,
        num_kv_heads,
        max(1, int(kv_lens.sum())),
        num_ctas,
        max(1, fixed_split_len // ops.DECODE_TILE_TOKENS),
    )
    plan = torch.zeros(ops.decode_plan_size(max_units, max_ctas), dtype=torch.int32)
    ops.plan_decode(
        kv_lens.contiguous(),
        plan,
        num_kv_heads=num_kv_heads,
        query_tokens=query_tokens,
        window=window,
        num_ctas=num_ctas if mode != ops.SplitMode.STATIC else max_ctas,
        max_units=max_units,
        min_split_tiles=min_split_len // ops.DECODE_TILE_TOKENS,
        mode=mode,
        split_tiles=fixed_split_len // ops.DECODE_TILE_TOKENS,
        group=group,
        kv_element_bytes=kv_element_bytes,
    )
    return plan
