# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Persistent state of the HPC attention kernels: the decode and prefill plans.

``DecodeWorkspace`` and ``PrefillWorkspace`` are sized once for the largest
step (the ``HPC_ATTN`` metadata builder creates them in its ``__init__``) and
planned once per step for all layers; ``vllm._hpc_ops.decode_attention`` and
``prefill_attention`` follow the plans. Nothing is allocated per step, so the
planners and the kernels are CUDA-graph capturable.

This module imports torch and ``vllm._hpc_ops`` only, so it works, like the
op layer, on a machine that has the compiled library but no vLLM.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm._hpc_ops import (
    _DECODE_KV_DTYPES,
    DECODE_TILE_TOKENS,
    SUPPORTED_HEAD_SIZES,
    SplitMode,
    _check_contiguous,
    _check_dtype,
    _check_gqa,
    _check_lengths,
    _check_ndim,
    _check_positive,
    _check_query_tokens,
    _check_split_len,
    _check_tensor,
    _require_library,
    _resolve_mode,
    decode_plan_size,
)

__all__ = ["DecodeWorkspace", "PrefillWorkspace", "decode_workspace_sizes"]

# A packed prefill tile keeps its KV head in the low 8 bits (prefill_plan.h).
_PREFILL_MAX_KV_HEADS = 256
_INT32_MAX = 2**31 - 1


def decode_workspace_sizes(
    mode: SplitMode,
    max_batch: int,
    num_kv_heads: int,
    max_kv_tokens: int,
    num_ctas: int,
    split_tiles: int,
) -> tuple[int, int]:
    """(plan CTA slots, partial rows) a decode workspace needs for every
    step of up to ``max_batch`` sequences over ``max_kv_tokens`` cached
    tokens, asked of the planner (decode_plan.h ``workspace_sizes``)."""
    _require_library()
    plan_ctas, max_partials = torch.ops._hpc_C.decode_workspace_sizes(
        int(mode), max_batch, num_kv_heads, max_kv_tokens, num_ctas, split_tiles
    )
    return int(plan_ctas), int(max_partials)


def _device_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclasses.dataclass
class DecodeWorkspace:
    """Persistent state of split-KV decode: the plan and the partial buffers.

    Created once (from the maximum batch, the KV-cache capacity and the
    device's SM count) and reused every step: :meth:`plan` runs the GPU
    planner for the step's lengths (once for all layers), and
    ``vllm._hpc_ops.decode_attention`` follows the plan. Nothing is allocated
    per call, so both are CUDA-graph capturable.
    """

    plan_buffer: torch.Tensor
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    piece_counters: torch.Tensor  # int32 [max_units], zero between calls
    max_batch: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    max_query_tokens: int
    num_ctas: int
    max_ctas: int
    mode: SplitMode
    min_split_tiles: int
    split_tiles: int
    window: int

    @property
    def max_units(self) -> int:
        return self.max_batch * self.num_kv_heads

    @classmethod
    def create(
        cls,
        *,
        max_batch: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_size: int,
        max_kv_tokens: int,
        device: torch.device | str,
        max_query_tokens: int = 1,
        kv_cache_dtype: torch.dtype = torch.bfloat16,
        mode: SplitMode | None = None,
        min_split_len: int = 256,
        fixed_split_len: int = 0,
        window: int = 0,
        num_ctas: int | None = None,
    ) -> DecodeWorkspace:
        """Sizes the workspace.

        ``max_kv_tokens``: KV-cache capacity in tokens (blocks x block size);
        it bounds the pieces of the batch-invariant and static modes.
        ``mode``: default BALANCED, or BATCH_INVARIANT when
        ``fixed_split_len`` is given.
        ``kv_cache_dtype``: the cache's dtype (checked against the decode
        kernel's). ``num_ctas``: persistent CTAs (default: the SM count times
        the decode kernel's CTAs per SM, asked of the library).
        """
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        _check_positive(
            max_batch=max_batch, num_kv_heads=num_kv_heads, max_kv_tokens=max_kv_tokens
        )
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"head_size is {head_size}; accepted: {SUPPORTED_HEAD_SIZES}"
            )
        _check_gqa(num_q_heads, num_kv_heads)
        group = num_q_heads // num_kv_heads
        _check_query_tokens(max_query_tokens, group)
        _check_split_len("min_split_len", min_split_len)
        _check_split_len("fixed_split_len", fixed_split_len)
        mode = _resolve_mode(mode, fixed_split_len)
        if window < 0:
            raise ValueError(
                f"window is {window}; accepted: 0 (none) or a positive int"
            )
        _check_dtype(
            "kv_cache_dtype", torch.empty(0, dtype=kv_cache_dtype), _DECODE_KV_DTYPES
        )
        if num_ctas is None:
            _require_library()
            elem_bytes = 1 if kv_cache_dtype == torch.float8_e4m3fn else 2
            num_ctas = _device_sm_count(device) * torch.ops._hpc_C.decode_ctas_per_sm(
                head_size, elem_bytes
            )
        _check_positive(num_ctas=num_ctas)
        max_units = max_batch * num_kv_heads
        split_tiles = fixed_split_len // DECODE_TILE_TOKENS
        max_ctas, max_partials = decode_workspace_sizes(
            mode, max_batch, num_kv_heads, max_kv_tokens, num_ctas, split_tiles
        )
        rows = max_query_tokens * group
        return cls(
            plan_buffer=torch.zeros(
                decode_plan_size(max_units, max_ctas), dtype=torch.int32, device=device
            ),
            partial_out=torch.empty(
                max_partials * rows * head_size, dtype=torch.float32, device=device
            ),
            partial_lse=torch.empty(
                max_partials * rows, dtype=torch.float32, device=device
            ),
            piece_counters=torch.zeros(max_units, dtype=torch.int32, device=device),
            max_batch=max_batch,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            max_query_tokens=max_query_tokens,
            num_ctas=num_ctas,
            max_ctas=max_ctas,
            mode=mode,
            min_split_tiles=min_split_len // DECODE_TILE_TOKENS,
            split_tiles=split_tiles,
            window=window,
        )

    def plan(self, kv_lens: torch.Tensor, query_tokens: int = 1) -> None:
        """Runs the GPU planner for this step's KV lengths (int32 ``[batch]``
        on the workspace's device, including the query tokens)."""
        _check_tensor("kv_lens", kv_lens)
        _check_ndim("kv_lens", kv_lens, 1, "[batch]")
        _check_dtype("kv_lens", kv_lens, (torch.int32,))
        if kv_lens.device != self.plan_buffer.device:
            raise ValueError(
                f"kv_lens is on {kv_lens.device}; expected {self.plan_buffer.device}"
            )
        _check_contiguous("kv_lens", kv_lens)
        if kv_lens.shape[0] > self.max_batch:
            raise ValueError(
                f"batch {kv_lens.shape[0]} exceeds the workspace's max_batch "
                f"{self.max_batch}"
            )
        _check_query_tokens(query_tokens)
        if query_tokens > self.max_query_tokens:
            raise ValueError(
                f"query_tokens is {query_tokens}; this workspace accepts "
                f"1..{self.max_query_tokens}"
            )
        _require_library()
        torch.ops._hpc_C.plan_decode(
            kv_lens,
            self.plan_buffer,
            self.num_kv_heads,
            query_tokens,
            self.window,
            self.max_ctas if self.mode == SplitMode.STATIC else self.num_ctas,
            self.max_units,
            self.min_split_tiles,
            int(self.mode),
            self.split_tiles,
        )


@dataclasses.dataclass
class PrefillWorkspace:
    """The tile plan of paged prefill attention.

    Created once for the largest step (``max_tokens`` query tokens in up to
    ``max_batch`` requests) and reused: :meth:`plan` runs the planner for the
    step's lengths, once for all layers, and
    ``vllm._hpc_ops.prefill_attention`` follows the plan. Nothing is
    allocated per call, so both are CUDA-graph capturable.
    """

    plan_buffer: torch.Tensor  # int32, flat
    max_tokens: int
    max_batch: int
    num_q_heads: int
    num_kv_heads: int
    max_tiles: int

    @classmethod
    def create(
        cls,
        *,
        max_tokens: int,
        max_batch: int,
        num_q_heads: int,
        num_kv_heads: int,
        device: torch.device | str,
    ) -> PrefillWorkspace:
        """Allocates a plan for up to ``max_tokens`` query tokens in up to
        ``max_batch`` requests with ``num_q_heads`` / ``num_kv_heads`` heads.
        ``device``: a CUDA device (the GPU planner), or the CPU, where
        :meth:`plan` runs the host planner (for tests; the attention itself
        needs CUDA)."""
        device = torch.device(device)
        if device.type not in ("cuda", "cpu"):
            raise ValueError(
                f"device must be a CUDA device (or the CPU for the host planner), "
                f"got {device}"
            )
        _check_positive(
            max_tokens=max_tokens, max_batch=max_batch, num_kv_heads=num_kv_heads
        )
        for name, value in (("max_tokens", max_tokens), ("max_batch", max_batch)):
            if value >= _INT32_MAX:
                raise ValueError(f"{name} is {value}; accepted: below 2**31 - 1")
        if num_kv_heads > _PREFILL_MAX_KV_HEADS:
            raise ValueError(
                f"num_kv_heads is {num_kv_heads}; accepted: 1..{_PREFILL_MAX_KV_HEADS}"
            )
        _check_gqa(num_q_heads, num_kv_heads)
        _require_library()
        layout = torch.ops._hpc_C.prefill_plan_layout(
            max_tokens, max_batch, num_q_heads, num_kv_heads
        )
        # [max_tiles, request_first_item, tiles, size] (ops.h).
        max_tiles, size = int(layout[0]), int(layout[-1])
        return cls(
            plan_buffer=torch.zeros(size, dtype=torch.int32, device=device),
            max_tokens=max_tokens,
            max_batch=max_batch,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            max_tiles=max_tiles,
        )

    def plan(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Plans the step: ``query_start_loc`` int32 ``[batch + 1]`` (request
        b's query tokens are rows ``[query_start_loc[b], query_start_loc[b +
        1])`` of ``q``) and ``seq_lens`` int32 ``[batch]`` (request b's keys,
        its cached context plus its new tokens), on the workspace's device.

        On a CUDA device the planner runs on the GPU without synchronising,
        so the lengths are not checked against the workspace: the total must
        be at most ``max_tokens`` query tokens, or the planner stops the
        launch with a device-side trap (which ends the CUDA context) instead
        of writing past the plan. On the CPU the host planner raises.
        """
        batch = _check_lengths(query_start_loc, seq_lens, self.plan_buffer.device)
        if batch > self.max_batch:
            raise ValueError(
                f"batch {batch} (seq_lens.shape[0]) exceeds the workspace's "
                f"max_batch {self.max_batch}"
            )
        _require_library()
        torch.ops._hpc_C.plan_prefill(
            query_start_loc,
            seq_lens,
            self.plan_buffer,
            self.num_q_heads,
            self.num_kv_heads,
            self.max_batch,
            self.max_tiles,
        )
