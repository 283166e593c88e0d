# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Persistent state of the HPC attention kernels: the decode and prefill plans.

``DecodeWorkspace`` and ``PrefillWorkspace`` are sized once for the largest
step (the ``HPC_ATTN`` metadata builder creates them in its ``__init__``) and
planned once per step for all layers; ``vllm._hpc_ops.decode_attention`` and
``prefill_attention`` follow the plans. Nothing is allocated per step, so the
planners and the kernels are CUDA-graph capturable.

The kernels are called through ``vllm._hpc_ops``, and the arguments of
``create`` and ``plan`` are checked by ``vllm._hpc_ops_validation``. This
module imports torch and those two only, so it works, like the op layer, on
a machine that has the compiled library but no vLLM.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm import _hpc_ops as ops
from vllm._hpc_ops import DECODE_TILE_TOKENS, SplitMode
from vllm._hpc_ops_validation import (
    validate_decode_plan,
    validate_decode_workspace,
    validate_prefill_plan,
    validate_prefill_workspace,
    validate_split_mode,
    validated_by,
)

__all__ = ["DecodeWorkspace", "PrefillWorkspace"]


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
    kv_element_bytes: int  # 1: FP8 cache, 2: 16-bit
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
    @validated_by(validate_decode_workspace)
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
        mode = validate_split_mode(
            mode, min_split_len=min_split_len, fixed_split_len=fixed_split_len
        )
        device = torch.device(device)
        elem_bytes = 1 if kv_cache_dtype == torch.float8_e4m3fn else 2
        if num_ctas is None:
            num_ctas = _device_sm_count(device) * ops.decode_ctas_per_sm(
                head_size, elem_bytes
            )
        group = num_q_heads // num_kv_heads
        max_units = max_batch * num_kv_heads
        split_tiles = fixed_split_len // DECODE_TILE_TOKENS
        max_ctas, max_partials = ops.decode_workspace_sizes(
            mode, max_batch, num_kv_heads, max_kv_tokens, num_ctas, split_tiles
        )
        rows = max_query_tokens * group
        return cls(
            plan_buffer=torch.zeros(
                ops.decode_plan_size(max_units, max_ctas),
                dtype=torch.int32,
                device=device,
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
            kv_element_bytes=elem_bytes,
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
        validate_decode_plan(self, kv_lens, query_tokens)
        ops.plan_decode(
            kv_lens,
            self.plan_buffer,
            num_kv_heads=self.num_kv_heads,
            query_tokens=query_tokens,
            window=self.window,
            num_ctas=self.max_ctas if self.mode == SplitMode.STATIC else self.num_ctas,
            max_units=self.max_units,
            min_split_tiles=self.min_split_tiles,
            mode=self.mode,
            split_tiles=self.split_tiles,
            group=self.num_q_heads // self.num_kv_heads,
            kv_element_bytes=self.kv_element_bytes,
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
    @validated_by(validate_prefill_workspace)
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
        layout = ops.prefill_plan_layout(
            max_tokens, max_batch, num_q_heads, num_kv_heads
        )
        max_tiles = layout["max_tiles"]
        return cls(
            plan_buffer=torch.zeros(layout["size"], dtype=torch.int32, device=device),
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
        validate_prefill_plan(self, query_start_loc, seq_lens)
        ops.plan_prefill(
            query_start_loc,
            seq_lens,
            self.plan_buffer,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            max_batch=self.max_batch,
            max_tiles=self.max_tiles,
        )
