# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Float64 reference of paged prefill attention, and input builders.

A prefill batch is a list of requests, each given as ``(q_len, kv_len)``:
the request has ``kv_len`` keys in the paged cache, and the last ``q_len`` of
them belong to its new query tokens (the first ``kv_len - q_len`` are cached
context). Query token ``i`` sits at position ``kv_len - q_len + i`` and sees
the keys at positions ``<= pos`` (causal, aligned bottom-right), and with a
window ``w > 0`` only those in ``(pos - w, pos]``.

For one request that is exactly what ``decode_reference.reference_decode``
computes with ``query_tokens = q_len`` at KV length ``kv_len``, so the
reference here calls it per request, a chunk of query rows at a time: rows
``[i0, i1)`` are the ``i1 - i0`` last queries of a sequence of
``kv_len - q_len + i1`` keys (the same positions; the keys past the chunk's
last position are masked for all its rows anyway). The chunks keep the
float64 logits of a 32K context to a bounded size.

The cache comes from ``decode_reference.make_decode_inputs`` over the
requests' KV lengths: the blocks are dealt to the requests in a random
order, block-table entries past a request's blocks name spare blocks, and
every element a kernel must never read (spare blocks, slots past each
request's ``kv_len`` in its last block) holds NaN. The new tokens' K and V
are in the cache like the context's: the op reads every key from it.

This module imports torch only (and the other references, which import
torch only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tests.kernels.hpc.decode_reference import (
    FP8_MAX,
    PagedInputs,
    check_whole,
    default_dtypes,
    make_decode_inputs,
    quantize_fp8,
    quantize_queries,
    reference_decode,
)
from tests.kernels.hpc.utils import FP8_DTYPE, CacheLayout, ErrorStats, error_stats

# The queries are drawn from a generator of their own, seeded apart from the
# cache's, so they are independent of the keys.
Q_SEED_OFFSET = 1 << 20

# Elements of one float64 logits block (query rows x query heads x keys) of
# the reference: 512 MiB.
REFERENCE_CHUNK_ELEMENTS = 1 << 26

# 16-bit queries over an FP8 cache are E4M3 values times 2**-7, the largest
# magnitude of every (token, head) row being exactly 448 * 2**-7 = 3.5. A
# kernel that quantises them with an amax / 448 scale or its power-of-two
# ceiling (per row, per token or per tensor) gets the scale 2**-7 and the
# same E4M3 values back exactly, and
# bf16 and fp16 hold them exactly, so the reference and the kernel use the
# same query values whichever way the kernel takes them.
Q_FP8_GRID = 2.0**-7


def on_fp8_grid(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, ``[..., D]``) rounded per row to E4M3 values times
    ``Q_FP8_GRID``, each row's largest magnitude mapped to
    ``FP8_MAX * Q_FP8_GRID``."""
    row_scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return quantize_fp8(x, row_scale).float() * Q_FP8_GRID


# ---------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------


def reference_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    lens: Sequence[tuple[int, int]],
    *,
    scale: float,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:
    """Prefill attention in float64, ``[tokens, Hq, D]``.

    ``q`` holds the requests' query tokens one request after the other;
    ``lens[b] = (q_len, kv_len)``. FP8 values are dequantised as
    ``x.float() * scale`` (``q_scale`` ``[tokens, Hq]``, ``k_scale`` and
    ``v_scale`` one-element tensors). Logits are ``scale * q.k``, soft-capped
    as ``c * tanh(logits / c)`` when ``softcap = c > 0``.
    """
    tokens, num_q_heads, head_size = q.shape
    if tokens != sum(q_len for q_len, _ in lens):
        raise ValueError(f"q has {tokens} rows for query lengths {list(lens)}")
    out = torch.empty(
        tokens, num_q_heads, head_size, dtype=torch.float64, device=q.device
    )
    start = 0
    for b, (q_len, kv_len) in enumerate(lens):
        chunk = max(1, REFERENCE_CHUNK_ELEMENTS // (num_q_heads * kv_len))
        for i0 in range(0, q_len, chunk):
            i1 = min(q_len, i0 + chunk)
            rows = slice(start + i0, start + i1)
            out[rows] = reference_decode(
                q[rows],
                key_cache,
                value_cache,
                block_table[b : b + 1],
                [kv_len - q_len + i1],
                scale=scale,
                query_tokens=i1 - i0,
                q_scale=None if q_scale is None else q_scale[rows],
                k_scale=k_scale,
                v_scale=v_scale,
                softcap=softcap,
                window=window,
            )
        start += q_len
    return out


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class PrefillInputs(PagedInputs):
    """Everything ``prefill_attention`` takes, plus what built it."""

    lens: list[tuple[int, int]]  # (q_len, kv_len) per request
    q: torch.Tensor
    q_scale: torch.Tensor | None
    storage: tuple[torch.Tensor, ...]  # tensors that hold the K/V views
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    out: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scale: float
    softcap: float
    window: int
    layout: CacheLayout

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    def workspace_kwargs(
        self, spare_tokens: int = 0, spare_batch: int = 0
    ) -> dict[str, object]:
        """``PrefillWorkspace.create`` arguments for these inputs, with room
        for ``spare_tokens`` more tokens and ``spare_batch`` more requests."""
        return {
            "max_tokens": self.num_tokens + spare_tokens,
            "max_batch": self.batch + spare_batch,
            "num_q_heads": self.num_q_heads,
            "num_kv_heads": self.num_kv_heads,
            "device": self.q.device,
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
        torch.Tensor,
    ]:
        """The op's positional arguments before the workspace."""
        return (
            self.q,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
            self.out,
        )

    def op_kwargs(self) -> dict[str, object]:
        return {
            "scale": self.scale,
            "q_scale": self.q_scale,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
            "softcap": self.softcap,
            "window": self.window,
        }

    def reference(self) -> torch.Tensor:
        """The reference of these inputs, with the op's keyword arguments."""
        return reference_prefill(
            self.q,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.lens,
            **self.op_kwargs(),  # type: ignore[arg-type]
        )

    def check(self, what: str = "") -> ErrorStats:
        """``out`` against the reference (``check_prefill``)."""
        return check_prefill(
            self.out,
            self.reference(),
            self.lens,
            fp8=self.fp8,
            fp8_p=self.key_cache.dtype == FP8_DTYPE,
            what=what,
        )

    def copy_into(self, other: PrefillInputs) -> None:
        """Copy these inputs' contents into ``other``'s tensors (same shapes:
        for CUDA-graph replays). ``other.lens`` follows."""
        pairs = [
            (other.q, self.q),
            (other.block_table, self.block_table),
            (other.query_start_loc, self.query_start_loc),
            (other.seq_lens, self.seq_lens),
            *zip(other.storage, self.storage, strict=True),
        ]
        self.copy_tensors_into(other, pairs)


def make_prefill_inputs(
    lens: Sequence[tuple[int, int]],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    kv_dtype: torch.dtype = torch.bfloat16,
    q_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    layout: CacheLayout = CacheLayout.SEPARATE,
    scale: float | None = None,
    softcap: float = 0.0,
    window: int = 0,
    num_blocks: int | None = None,
    max_blocks: int | None = None,
    q_on_fp8_grid: bool = True,
    seed: int = 0,
    device: torch.device | str = "cuda",
) -> PrefillInputs:
    """Fresh random inputs for requests ``lens = [(q_len, kv_len), ...]``
    with ``1 <= q_len <= kv_len``.

    ``q_dtype`` defaults to the cache dtype (bf16 for an FP8 cache),
    ``out_dtype`` to the query dtype (bf16 for FP8 queries), ``scale`` to
    ``1 / sqrt(head_size)``. FP8 queries get per-(token, head) scales
    ``amax / 448``; 16-bit queries over an FP8 cache lie on the grid of
    ``on_fp8_grid`` unless ``q_on_fp8_grid`` is false (then the kernel's
    own rounding of them is part of the measured error). ``num_blocks`` and
    ``max_blocks`` (default: what the requests need, plus spares) size the
    cache and the block table as in ``make_decode_inputs``. ``out`` holds
    NaN.
    """
    lens = [(int(q_len), int(kv_len)) for q_len, kv_len in lens]
    for q_len, kv_len in lens:
        if not 1 <= q_len <= kv_len:
            raise ValueError(f"request ({q_len}, {kv_len}): need 1 <= q_len <= kv_len")
    device = torch.device(device)
    q_dtype, out_dtype, scale = default_dtypes(
        kv_dtype, q_dtype, out_dtype, scale, head_size
    )

    cache = make_decode_inputs(
        [kv_len for _, kv_len in lens],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        kv_dtype=kv_dtype,
        layout=layout,
        num_blocks=num_blocks,
        max_blocks=max_blocks,
        seed=seed,
        device=device,
    )

    q_lens = [q_len for q_len, _ in lens]
    tokens = sum(q_lens)
    gen = torch.Generator(device=device).manual_seed(seed + Q_SEED_OFFSET)
    q_full = torch.randn(tokens, num_q_heads, head_size, generator=gen, device=device)
    q_scale = None
    if q_dtype == FP8_DTYPE:
        q, q_scale = quantize_queries(q_full)
    elif kv_dtype == FP8_DTYPE and q_on_fp8_grid:
        q = on_fp8_grid(q_full).to(q_dtype)
    else:
        q = q_full.to(q_dtype)

    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    out = torch.full(
        (tokens, num_q_heads, head_size), float("nan"), dtype=out_dtype, device=device
    )
    return PrefillInputs(
        lens=lens,
        q=q,
        q_scale=q_scale,
        storage=cache.storage,
        key_cache=cache.key_cache,
        value_cache=cache.value_cache,
        block_table=cache.block_table,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=cache.kv_lens,
        out=out,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        scale=float(scale),
        softcap=float(softcap),
        window=int(window),
        layout=layout,
    )


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def check_prefill(
    out: torch.Tensor,
    ref: torch.Tensor,
    lens: Sequence[tuple[int, int]],
    *,
    fp8: bool,
    fp8_p: bool = False,
    what: str = "",
) -> ErrorStats:
    """Fail unless ``out`` is finite and close to ``ref``: the relative
    Frobenius error over the whole output and over each request's rows
    (1e-2, 3e-2 with FP8, 5e-2 with FP8 probabilities: ``fp8_p``, an FP8
    cache on FP8 tensor cores), and the largest absolute error."""
    prefix = f"{what}: " if what else ""
    assert out.shape == ref.shape, (
        f"{prefix}out shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    )
    stats, rtol = check_whole(out, ref, fp8=fp8, fp8_p=fp8_p, prefix=prefix)
    start = 0
    for b, (q_len, kv_len) in enumerate(lens):
        rows = slice(start, start + q_len)
        seq = error_stats(out[rows], ref[rows])
        assert seq.rel <= rtol, (
            f"{prefix}request {b} (q_len {q_len}, kv_len {kv_len}): {seq} "
            f"exceeds rtol={rtol:g}"
        )
        start += q_len
    assert start == out.shape[0], f"{prefix}{out.shape[0]} rows for {start} tokens"
    return stats


# ---------------------------------------------------------------------------
# Plans: a reader (it needs the library, which a workspace implies)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """A prefill plan copied to the host.

    The plan lists every (request, m-block, KV head) tile of the batch: an
    m-block is ``tile_tokens`` consecutive query tokens of one request, all
    query heads of one KV head. Tiles come longest first by cost bucket
    (keys the block's last query token sees, shifted right by
    ``cost_shift``), KV-head-major inside each bucket.
    """

    num_tiles: int
    tile_tokens: int
    num_kv_heads: int
    batch: int
    max_batch: int
    max_tiles: int
    cost_shift: int
    request_first_item: torch.Tensor  # int32 [batch + 1]: m-block prefix
    tiles: torch.Tensor  # int32 [num_tiles, 3]: request, m_block, kv_head


def read_prefill_plan(workspace) -> PrefillPlan:
    """The current plan of a ``PrefillWorkspace``, copied to the host
    (synchronises). The header is read by the names the library gives its
    fields (``prefill_plan_header_fields``, from offset 0) and the arrays at
    the offsets of its layout (``prefill_plan_layout``), so a field added in
    C++ fails here instead of shifting the others."""
    plan = workspace.plan_buffer.cpu()
    names = list(torch.ops._hpc_C.prefill_plan_header_fields())
    header = dict(zip(names, map(int, plan[: len(names)].tolist()), strict=True))
    from vllm import _hpc_ops as ops

    layout = ops.prefill_plan_layout(
        workspace.max_tokens,
        workspace.max_batch,
        workspace.num_q_heads,
        workspace.num_kv_heads,
    )
    first, at = layout["request_first_item"], layout["tiles"]
    # A tile is (request, m_block << 8 | kv_head) (prefill_plan.h pack_tile).
    packed = plan[at : at + 2 * header["num_tiles"]].view(-1, 2)
    tiles = torch.stack((packed[:, 0], packed[:, 1] >> 8, packed[:, 1] & 0xFF), dim=1)
    return PrefillPlan(
        **header,
        request_first_item=plan[first : first + header["batch"] + 1],
        tiles=tiles,
    )
