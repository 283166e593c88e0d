# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""HPC attention backend for Hopper, on the in-tree ``vllm._hpc_C`` kernels.

Decode rows (1..8 uniform query tokens per request, speculative decoding
included) go to the split-KV paged decode kernel; every other row (prefills,
chunked prefills, and the one-token rows a speculative batch counts as
prefills) goes to the paged prefill kernel. Both read K and V as strided
``[num_blocks, block_size, num_kv_heads, head_size]`` views of vLLM's cache.

What it covers: bf16/fp16 models; KV cache in the model dtype or FP8-E4M3
(``fp8``/``fp8_e4m3``, per-tensor scales, with bf16/fp16 queries or the FP8
queries of ``HpcRopeNorm``); head sizes 64/128/256; any GQA ratio up to 16;
kernel block sizes 16/32/64 (larger manager blocks are split); sliding window
and logits soft-cap; decoder attention on compute capability 9.x.

KV cache layout: the packed page vLLM 0.33 allocates for a ``[B, H, N, 2D]``
logical cache, K and V side by side in the last dimension. ``LBNHC`` (token,
then head, then ``[K|V]``) is preferred; ``LBHNC`` (head-major pages) is
accepted too, since the kernels take any strides. A layout with K and V in
separate regions is not one 0.33 can allocate for this logical shape; whether
it would be faster is left to measurement.

Per step, the builder plans once for all layers of a KV-cache group, on the
GPU and without a host synchronisation: one decode plan
(``DecodeWorkspace.plan``) and one prefill plan (``PrefillWorkspace.plan``)
over prefill offsets rebased to 0 in a persistent buffer. Every tensor the
kernels read lives at a fixed address, so FULL CUDA graphs of uniform decode
batches replay correctly after ``build`` refreshed the plans.

K/V are written by ``do_kv_cache_update`` (vLLM's ``unified_kv_cache_update``
op, run before the attention op), through vLLM's ``reshape_and_cache_flash``.
``HpcRopeNorm`` (the fused QK-norm + RoPE + KV-write prologue that models such
as Hy3 wire) writes them itself; the model then calls the attention layer
with ``key=None, value=None`` (``supports_kv_cache_update_bypass``), so vLLM
does not ask for the write. Its FP8 Q scales reach ``forward`` through the
``hpc_*_q_scale`` fields of ``HpcAttnMetadata``, which ``forward`` consumes
and resets, so they never reach another layer sharing the metadata, nor
another step.

Models that do not wire the prologue can get the same kernel through vLLM's
QK-norm + RoPE + KV-cache and RoPE + KV-cache fusion passes, whose impl hooks
(``do_qk_norm_rope_kvcache_update``, ``do_rope_and_kv_cache_update``) launch
``rope_norm_store_kv``. vLLM 0.33 switches those passes off outside ROCm
(``PassConfig.__post_init__``); where they are allowed they are asked for
with ``-cc '{"pass_config": {"fuse_qk_norm_rope_kvcache": true},
"use_inductor_graph_partition": true}'`` (or ``fuse_rope_kvcache``, and
``"splitting_ops": []`` instead of the graph partition), and apply to
bf16/fp16 models in compiled ranges of at most
``pass_config.rope_kvcache_fusion_max_token_num`` tokens.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm._custom_ops import reshape_and_cache_flash
from vllm._hpc_ops import (
    MAX_DECODE_QUERY_TOKENS,
    MAX_DECODE_ROWS,
    MAX_GQA_RATIO,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    QkNormPolicy,
    decode_attention,
    prefill_attention,
    rope_norm_store_kv,
)
from vllm.config import (
    VllmConfig,
    get_current_vllm_config_or_none,
    get_layers_from_vllm_config,
)
from vllm.config.cache import CacheDType
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.platforms.interface import DeviceCapability
from vllm.utils.hpc import has_hpc_kernels
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
    max_decode_query_len,
)
from vllm.v1.attention.backends.utils import (
    get_num_attention_heads_from_layers,
    split_decodes_and_prefills,
)
from vllm.v1.attention.ops.hpc_attn_workspace import DecodeWorkspace, PrefillWorkspace
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheLayout,
    KVCacheSpec,
    KVQuantMode,
)

logger = init_logger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
_FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_16BIT_KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_OUTPUT_DTYPES = (torch.bfloat16, torch.float16)
# Block size taken when the user did not choose one: the kernels' TMA tiles
# are 64 tokens long, so smaller blocks only add block-table lookups.
_PREFERRED_BLOCK_SIZE = 64


@dataclass(frozen=True)
class HpcLayerKvCache:
    """A layer's paged KV cache as the HPC kernels read and write it."""

    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size] view
    value: torch.Tensor  # the same, over V
    k_scale: torch.Tensor | None  # FP8 caches: the layer's scale, [1]
    v_scale: torch.Tensor | None


def layer_kv_cache(
    kv_cache: torch.Tensor, layer: Any, head_size: int, fp8: bool
) -> HpcLayerKvCache:
    """K, V and their scales of ``layer``'s packed cache page, without
    copying: the one place the backend's cache layout is read.

    ``kv_cache`` is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
    (K in the first half of the last dim, V in the second; FP8 caches stored
    as uint8 or float8_e4m3fn, read as float8_e4m3fn with the per-tensor
    scales ``layer._k_scale`` / ``layer._v_scale``, which share the layer's
    storage).
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(
            "kv_cache must be [num_blocks, num_kv_heads, block_size, "
            f"{2 * head_size}], got {tuple(kv_cache.shape)}"
        )
    if fp8 and kv_cache.dtype not in (torch.uint8, FP8_DTYPE):
        raise ValueError(
            "an FP8 kv_cache must be stored as uint8 or float8_e4m3fn, got "
            f"{kv_cache.dtype}"
        )
    key, value = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    if not fp8:
        return HpcLayerKvCache(key, value, None, None)
    return HpcLayerKvCache(
        key.view(FP8_DTYPE),
        value.view(FP8_DTYPE),
        layer._k_scale.reshape(1),
        layer._v_scale.reshape(1),
    )


def derive_positions(
    seq_lens: torch.Tensor,
    num_tokens: int,
    decode_query_start_loc: torch.Tensor | None,
    prefill_query_start_loc: torch.Tensor | None,
    num_decode_tokens: int,
) -> torch.Tensor:
    """Position of every token of a batch, computed on ``seq_lens.device``.

    The batch holds the decode requests first, then the prefill requests, in
    the order of ``seq_lens`` (the KV length of each request *including* the
    tokens of this step). The query offsets are cumulative token counts:

    * ``decode_query_start_loc``: ``[num_decodes + 1]``, starting at 0;
      ``None`` when there are no decode requests.
    * ``prefill_query_start_loc``: ``[num_prefills + 1]``, relative to the
      first prefill token (so it also starts at 0); ``None`` when there are no
      prefill requests. Prefill token ``i`` is batch token
      ``num_decode_tokens + i``.

    A token ``t`` of request ``r`` whose query ends (exclusively) at
    ``query_end[r]`` sits at position
    ``seq_lens[r] - (query_end[r] - t)``: the last query token of a request is
    at ``seq_len - 1``. Tokens past the last request (padding) get position 0,
    and results are clamped at 0.

    Only tensor shapes and Python ints are read on the host, so this is safe
    under CUDA graph capture. Returns an int64 tensor of ``num_tokens``.
    """
    device = seq_lens.device
    ends: list[torch.Tensor] = []
    if decode_query_start_loc is not None:
        ends.append(decode_query_start_loc[1:].to(torch.int64))
    if prefill_query_start_loc is not None:
        ends.append(prefill_query_start_loc[1:].to(torch.int64) + num_decode_tokens)
    num_reqs = sum(int(e.shape[0]) for e in ends)
    if num_reqs == 0:
        return torch.zeros(num_tokens, dtype=torch.int64, device=device)
    if seq_lens.shape[0] < num_reqs:
        raise ValueError(
            f"seq_lens has {seq_lens.shape[0]} entries but the query offsets "
            f"describe {num_reqs} requests"
        )

    query_ends = torch.cat(ends).to(device)
    tokens = torch.arange(num_tokens, dtype=torch.int64, device=device)
    # Index of the first request whose query ends after token t.
    req = torch.searchsorted(query_ends, tokens, right=True)
    req = req.clamp_(max=num_reqs - 1)
    lens = seq_lens[:num_reqs].to(torch.int64)
    positions = lens[req] - (query_ends[req] - tokens)
    positions = torch.where(tokens < query_ends[-1], positions, 0)
    return positions.clamp_(min=0)


def run_prologue(
    layer: Any,
    kv_cache: torch.Tensor,
    head_size: int,
    fp8: bool,
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_out: torch.Tensor,
    *,
    norm_policy: QkNormPolicy,
    is_neox: bool,
    q_scale: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """The attention prologue of one layer in one launch: per-head RMSNorm
    (``norm_policy``) and RoPE of Q and K, K and V written into ``layer``'s
    cache, Q into ``q_out`` (FP8 with per-row scales into ``q_scale`` when
    ``q_out`` is FP8). The one body behind HpcRopeNorm and the fusion-pass
    hooks; ``qkv`` holds the packed [T, (Hq + 2 Hkv) head_size] rows."""
    kv = layer_kv_cache(kv_cache, layer, head_size, fp8)
    rope_norm_store_kv(
        qkv,
        positions,
        slot_mapping,
        cos_sin_cache,
        kv.key,
        kv.value,
        q_out,
        q_scale=q_scale,
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
        k_scale=kv.k_scale,
        v_scale=kv.v_scale,
        eps=eps,
        norm_policy=int(norm_policy),
        is_neox=is_neox,
    )


def _num_speculative_tokens(vllm_config: VllmConfig) -> int:
    spec_config = vllm_config.speculative_config
    if spec_config is None or spec_config.num_speculative_tokens is None:
        return 0
    return spec_config.num_speculative_tokens


@dataclass
class HpcAttnMetadata(AttentionMetadata):
    """Per-step metadata, shared by every layer of one KV-cache group.

    The batch holds ``num_decodes`` decode requests (``decode_query_len``
    query tokens each, rows ``[0, num_decode_tokens)``) followed by
    ``num_prefills`` other requests (rows ``num_decode_tokens`` onwards).
    """

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    """Query rows of the prefill requests (padding rows excluded)."""
    max_query_len: int
    max_seq_len: int

    slot_mapping: torch.Tensor
    """KV-cache slot of every token, -1 for padding. [num_actual_tokens]"""
    seq_lens: torch.Tensor
    """KV length of every request including this step's tokens. [num_reqs]"""
    block_table_tensor: torch.Tensor
    """Kernel-block ids of every request. [num_reqs, max_blocks]"""

    qo_indptr: torch.Tensor | None = None
    """Query offsets of the prefill requests, rebased to start at 0 (a view of
    a persistent GPU buffer). [num_prefills + 1]; None without prefills."""
    decode_query_len: int = 1
    """Query tokens per decode request: 1, or 1 + the speculative tokens."""
    qo_indptr_decode: torch.Tensor | None = None
    """Query offsets of the decode requests. [num_decodes + 1]; None without
    decodes."""
    positions: torch.Tensor | None = None
    """Token positions: the model runner's, or derived by the builder when it
    gives none (None only on metadata built by hand)."""

    decode_seq_lens: torch.Tensor | None = None
    decode_block_table: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_block_table: torch.Tensor | None = None
    decode_workspace: DecodeWorkspace | None = None
    """Holds this step's decode plan (planned in ``build``)."""
    prefill_workspace: PrefillWorkspace | None = None
    """Holds this step's prefill plan (planned in ``build``)."""

    # --- hand-off from HpcRopeNorm ---------------------------------------
    # Written by the prologue of a layer and consumed (then reset) by the
    # attention of the same layer, before the next layer's prologue runs.
    hpc_decode_q_scale: torch.Tensor | None = None
    """FP8 Q scales of the decode rows. [num_decode_tokens, num_heads]"""
    hpc_prefill_q_scale: torch.Tensor | None = None
    """FP8 Q scales from the first prefill row on, [>= num_prefill_tokens,
    num_heads] (the prologue also covers padding rows)."""
    hpc_q_scale_buffer: torch.Tensor | None = None
    """Persistent float32 [max_num_batched_tokens, num_heads] buffer the
    prologue writes FP8 Q scales into (FP8 caches only)."""


class HpcAttnMetadataBuilder(AttentionMetadataBuilder[HpcAttnMetadata]):
    """Splits the batch, plans both kernels once per step, owns their state."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    reorder_batch_threshold: int = 1

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

        model_config = vllm_config.model_config
        parallel_config = vllm_config.parallel_config
        scheduler_config = vllm_config.scheduler_config
        self.num_q_heads = get_num_attention_heads_from_layers(
            vllm_config, layer_names
        ) or model_config.get_num_attention_heads(parallel_config)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        # Refused at selection already (supports_combination); a builder
        # made directly gets the same reason.
        reason = _decode_rows_unsupported_reason(
            self.reorder_batch_threshold, self.num_q_heads // self.num_kv_heads
        )
        if reason is not None:
            raise ValueError(f"HPC_ATTN: {reason}")
        self.window = self._layer_window(
            vllm_config,
            layer_names,
            getattr(kv_cache_spec, "sliding_window", None) or 0,
        )
        self.use_fp8 = kv_cache_spec.kv_quant_mode == KVQuantMode.FP8_PER_TENSOR
        max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_tokens = scheduler_config.max_num_batched_tokens
        max_model_len = model_config.max_model_len

        # Sized once for the largest step; nothing is allocated per step, so
        # the addresses captured in CUDA graphs stay valid.
        self.decode_workspace = DecodeWorkspace.create(
            max_batch=max_num_seqs,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            # Bounds the KV tokens one step can reference.
            max_kv_tokens=max_num_seqs * max_model_len,
            device=device,
            max_query_tokens=self.reorder_batch_threshold,
            kv_cache_dtype=FP8_DTYPE if self.use_fp8 else kv_cache_spec.dtype,
            window=self.window,
        )
        self.prefill_workspace = PrefillWorkspace.create(
            max_tokens=self.max_num_tokens,
            max_batch=max_num_seqs,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            device=device,
        )
        self.prefill_query_start_loc = torch.zeros(
            max_num_seqs + 1, dtype=torch.int32, device=device
        )
        self.q_scale_buffer: torch.Tensor | None = None
        if self.use_fp8:
            self.q_scale_buffer = torch.zeros(
                self.max_num_tokens,
                self.num_q_heads,
                dtype=torch.float32,
                device=device,
            )

    @staticmethod
    def _layer_window(
        vllm_config: VllmConfig, layer_names: list[str], spec_window: int
    ) -> int:
        """The sliding window shared by the group's layers.

        The decode planner applies one window to every layer of the group,
        so the layers' impls must agree on it; without layers to ask (tests,
        drafting), the KV-cache spec's window is taken.
        """
        layers = get_layers_from_vllm_config(
            vllm_config,
            AttentionLayerBase,  # type: ignore[type-abstract]
            layer_names,
        )
        windows = {
            impl.window
            for layer in layers.values()
            if isinstance(impl := getattr(layer, "impl", None), HpcAttentionImpl)
        }
        if len(windows) > 1:
            raise ValueError(
                f"HPC_ATTN: the layers {layer_names} of one KV-cache group have "
                f"different sliding windows {sorted(windows)}; the decode plan "
                "takes one"
            )
        return windows.pop() if windows else spec_window

    @classmethod
    def get_cudagraph_support(
        cls: type[HpcAttnMetadataBuilder],
        vllm_config: VllmConfig,
        kv_cache_spec: KVCacheSpec,
    ) -> AttentionCGSupport:
        # FULL graphs hold uniform decode batches only: mixed batches need the
        # prefill kernel, whose launch depends on Python-side counts.
        if _num_speculative_tokens(vllm_config) > 0:
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> HpcAttnMetadata:
        cm = common_attn_metadata
        threshold = self.reorder_batch_threshold
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=threshold, require_uniform=threshold > 1
        )
        num_reqs = num_decodes + num_prefills
        seq_lens = cm.seq_lens
        block_table = cm.block_table_tensor

        metadata = HpcAttnMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            num_prefill_tokens=0,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            slot_mapping=cm.slot_mapping,
            seq_lens=seq_lens,
            block_table_tensor=block_table,
            positions=cm.positions,
            decode_workspace=self.decode_workspace,
            prefill_workspace=self.prefill_workspace,
            hpc_q_scale_buffer=self.q_scale_buffer,
        )

        if num_decodes > 0:
            query_len = num_decode_tokens // num_decodes
            if (
                query_len * num_decodes != num_decode_tokens
                or query_len > self.decode_workspace.max_query_tokens
            ):
                raise ValueError(
                    f"HPC_ATTN: {num_decodes} decode requests hold "
                    f"{num_decode_tokens} tokens; the decode kernel needs the "
                    f"same 1..{self.decode_workspace.max_query_tokens} tokens "
                    "in each"
                )
            metadata.decode_query_len = query_len
            metadata.qo_indptr_decode = cm.query_start_loc[: num_decodes + 1]
            metadata.decode_seq_lens = seq_lens[:num_decodes]
            metadata.decode_block_table = block_table[:num_decodes]
            self.decode_workspace.plan(metadata.decode_seq_lens, query_len)

        if num_prefills > 0:
            # The host copy gives the exact token count (padding rows past
            # the last request excluded) without a device synchronisation.
            num_prefill_tokens = (
                int(cm.query_start_loc_cpu[num_reqs]) - num_decode_tokens
            )
            if num_prefill_tokens > self.max_num_tokens:
                raise ValueError(
                    f"HPC_ATTN: {num_prefill_tokens} prefill tokens exceed the "
                    f"{self.max_num_tokens} the prefill plan was sized for"
                )
            qo_indptr = self.prefill_query_start_loc[: num_prefills + 1]
            torch.sub(
                cm.query_start_loc[num_decodes : num_reqs + 1],
                num_decode_tokens,
                out=qo_indptr,
            )
            metadata.num_prefill_tokens = num_prefill_tokens
            metadata.qo_indptr = qo_indptr
            metadata.prefill_seq_lens = seq_lens[num_decodes:num_reqs]
            metadata.prefill_block_table = block_table[num_decodes:num_reqs]
            self.prefill_workspace.plan(qo_indptr, metadata.prefill_seq_lens)

        if metadata.positions is None:
            # vLLM's model runner gives positions; other callers may not.
            metadata.positions = derive_positions(
                seq_lens,
                cm.num_actual_tokens,
                metadata.qo_indptr_decode,
                metadata.qo_indptr,
                num_decode_tokens,
            )
        return metadata


class HpcAttentionBackend(AttentionBackend):
    """Capabilities of the HPC kernels, checked at backend selection."""

    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto",
        "bfloat16",
        "float16",
        "fp8",
        "fp8_e4m3",
    ]
    # K/V are written by do_kv_cache_update (vLLM's unified_kv_cache_update
    # op), which the QK-norm/RoPE + KV-cache fusion passes replace with the
    # fused prologue; a model whose HpcRopeNorm wrote them calls attention
    # with key=None, value=None, and vLLM skips the write.
    forward_includes_kv_cache_update: bool = False
    supports_kv_cache_update_bypass: bool = True

    @staticmethod
    def get_supported_kernel_block_sizes(
        kv_cache_spec: KVCacheSpec | None = None,
    ) -> list[int | MultipleOf]:
        return list(SUPPORTED_BLOCK_SIZES)

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        preferred = max(default_block_size, _PREFERRED_BLOCK_SIZE)
        if cls.supports_block_size(preferred):
            return preferred
        return super().get_preferred_block_size(default_block_size)

    @staticmethod
    def get_name() -> str:
        return "HPC_ATTN"

    @staticmethod
    def get_impl_cls() -> type[HpcAttentionImpl]:
        return HpcAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[HpcAttnMetadataBuilder]:
        return HpcAttnMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        # sm_90a kernels (wgmma, TMA): Hopper only.
        return capability.major == 9

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # The decode/prefill split and the uniform decode query length are
        # read off the host query lengths.
        return False

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        if not has_hpc_kernels():
            return "the vllm._hpc_C kernel library is not built or failed to load"
        cache_dtype = _16BIT_KV_CACHE_DTYPES.get(kv_cache_dtype or "auto")
        if cache_dtype is not None and cache_dtype != dtype:
            return (
                f"kv_cache_dtype {kv_cache_dtype} differs from the model dtype "
                f"{dtype}; a 16-bit KV cache must match the queries"
            )
        # The selector is not told the head counts; read them off the model.
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None and vllm_config.model_config is not None:
            model_config = vllm_config.model_config
            parallel_config = vllm_config.parallel_config
            num_heads = model_config.get_num_attention_heads(parallel_config)
            num_kv_heads = model_config.get_num_kv_heads(parallel_config)
            reason = _gqa_unsupported_reason(num_heads, num_kv_heads)
            if reason is None:
                reason = _decode_rows_unsupported_reason(
                    max_decode_query_len(vllm_config), num_heads // num_kv_heads
                )
            if reason is not None:
                return reason
        return None


def _decode_rows_unsupported_reason(query_tokens: int, group: int) -> str | None:
    """Why decode requests of up to ``query_tokens`` query tokens (1 +
    speculative tokens, plus the drafting slots of parallel drafting) at GQA
    ratio ``group`` cannot run, or None."""
    if query_tokens > MAX_DECODE_QUERY_TOKENS:
        return (
            f"a decode request may carry {query_tokens} query tokens "
            f"(num_speculative_tokens and drafting), more than the decode "
            f"kernel's {MAX_DECODE_QUERY_TOKENS}: at most "
            f"{MAX_DECODE_QUERY_TOKENS - 1} speculative tokens"
        )
    if query_tokens * group > MAX_DECODE_ROWS:
        return (
            f"a decode request's {query_tokens} query tokens x GQA ratio {group} "
            f"are {query_tokens * group} rows per KV head, more than the decode "
            f"kernel's {MAX_DECODE_ROWS}"
        )
    return None


def _gqa_unsupported_reason(num_heads: int, num_kv_heads: int) -> str | None:
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        return (
            f"num_heads ({num_heads}) is not a positive multiple of num_kv_heads "
            f"({num_kv_heads})"
        )
    ratio = num_heads // num_kv_heads
    if ratio > MAX_GQA_RATIO:
        return (
            f"GQA ratio {ratio} (num_heads {num_heads} / num_kv_heads "
            f"{num_kv_heads}) exceeds the kernels' maximum of {MAX_GQA_RATIO}"
        )
    return None


class HpcAttentionImpl(AttentionImpl[HpcAttnMetadata]):
    """Writes K/V (unless the prologue did) and launches the decode and
    prefill kernels over their rows of the batch."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        # Everything the kernels depend on is checked here, once, so that
        # forward can launch the unchecked ops.
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"HPC_ATTN supports decoder attention only, got {attn_type}"
            )
        if alibi_slopes is not None:
            raise NotImplementedError("HPC_ATTN does not support ALiBi")
        if sinks is not None:
            raise NotImplementedError("HPC_ATTN does not support attention sinks")
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"HPC_ATTN supports head sizes {SUPPORTED_HEAD_SIZES}, got {head_size}"
            )
        reason = _gqa_unsupported_reason(num_heads, num_kv_heads)
        if reason is not None:
            raise ValueError(f"HPC_ATTN: {reason}")
        if kv_cache_dtype not in HpcAttentionBackend.supported_kv_cache_dtypes:
            raise ValueError(
                f"HPC_ATTN supports kv_cache_dtype "
                f"{HpcAttentionBackend.supported_kv_cache_dtypes}, got "
                f"{kv_cache_dtype!r}"
            )
        if not (math.isfinite(scale) and scale > 0.0):
            raise ValueError(
                f"HPC_ATTN: scale must be finite and positive, got {scale}"
            )
        softcap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
        if not (math.isfinite(softcap) and softcap >= 0.0):
            raise ValueError(
                f"HPC_ATTN: logits_soft_cap must be None, 0 or positive, got "
                f"{logits_soft_cap}"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(
                f"HPC_ATTN: sliding_window must be positive, got {sliding_window}"
            )

        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.logits_soft_cap = softcap
        # A query sees the keys in (pos - window, pos]: vLLM's sliding window
        # counts the query's own key.
        self.window = 0 if sliding_window is None else int(sliding_window)
        self.sliding_window = sliding_window
        self.use_fp8 = kv_cache_dtype in _FP8_KV_CACHE_DTYPES
        # The kernels take bf16/fp16 queries over an FP8 cache, so the layer
        # must not quantise them (its per-tensor scale is not the per-token
        # per-head layout the kernels read).
        self.supports_quant_query_input = False

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: HpcAttnMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for every row of the batch, written into ``output``.

        ``query`` [T, num_heads, head_size] (bf16/fp16, or FP8 from the
        prologue); ``key``/``value`` are not read: the kernels take K and V
        from the cache, written before this call; ``kv_cache``
        [num_blocks, num_kv_heads, block_size, 2 * head_size]; ``output``
        [T, num_heads, head_size] in the layer's output dtype.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("HPC_ATTN does not fuse output quantization")
        if attn_metadata is None:
            # Profiling run.
            return output.fill_(0)

        # NOTE: with piecewise CUDA graphs this runs eagerly for every layer,
        # so it only slices and launches: the checks were done in __init__
        # and in the builder (layer_kv_cache's two shape checks aside).
        md = attn_metadata
        decode_q_scale = md.hpc_decode_q_scale
        prefill_q_scale = md.hpc_prefill_q_scale
        # Consumed: the next layer sharing this metadata starts clean.
        md.hpc_decode_q_scale = None
        md.hpc_prefill_q_scale = None

        kv = layer_kv_cache(kv_cache, layer, self.head_size, self.use_fp8)
        if query.dtype == FP8_DTYPE:
            if output.dtype not in _OUTPUT_DTYPES:
                raise RuntimeError(
                    "HPC_ATTN: FP8 queries need a bf16/fp16 output; pass "
                    "output_dtype to the attention layer"
                )
            if (md.num_decodes and decode_q_scale is None) or (
                md.num_prefills and prefill_q_scale is None
            ):
                raise RuntimeError(
                    "HPC_ATTN: FP8 queries arrived without their per-token "
                    "scales from HpcRopeNorm (was the prologue captured into a "
                    "CUDA graph this forward did not replay?)"
                )
            if prefill_q_scale is not None:
                # The prologue covers padding rows too; the kernel reads the
                # prefill rows only.
                prefill_q_scale = prefill_q_scale[: md.num_prefill_tokens]
        else:
            decode_q_scale = prefill_q_scale = None

        num_decode_tokens = md.num_decode_tokens
        if md.num_decodes:
            # The builder sets the decode fields whenever there are decodes.
            assert md.decode_block_table is not None
            assert md.decode_seq_lens is not None
            assert md.decode_workspace is not None
            decode_attention(
                query[:num_decode_tokens],
                kv.key,
                kv.value,
                md.decode_block_table,
                md.decode_seq_lens,
                output[:num_decode_tokens],
                md.decode_workspace,
                scale=self.scale,
                query_tokens=md.decode_query_len,
                q_scale=decode_q_scale,
                k_scale=kv.k_scale,
                v_scale=kv.v_scale,
                softcap=self.logits_soft_cap,
            )
        if md.num_prefills:
            # Likewise the prefill fields whenever there are prefills.
            assert md.prefill_block_table is not None
            assert md.qo_indptr is not None
            assert md.prefill_seq_lens is not None
            assert md.prefill_workspace is not None
            end = num_decode_tokens + md.num_prefill_tokens
            prefill_attention(
                query[num_decode_tokens:end],
                kv.key,
                kv.value,
                md.prefill_block_table,
                md.qo_indptr,
                md.prefill_seq_lens,
                output[num_decode_tokens:end],
                md.prefill_workspace,
                scale=self.scale,
                q_scale=prefill_q_scale,
                k_scale=kv.k_scale,
                v_scale=kv.v_scale,
                softcap=self.logits_soft_cap,
                window=self.window,
            )
        return output

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Writes this step's K/V into the cache. vLLM does not call it for
        a layer whose prologue (HpcRopeNorm) wrote them: the model then calls
        attention with ``key=None, value=None``."""
        kv = layer_kv_cache(kv_cache, layer, self.head_size, self.use_fp8)
        # FP8 caches are written through views in the storage's dtype, as
        # vLLM's cache op expects; padding tokens have slot -1 and are skipped.
        reshape_and_cache_flash(
            key,
            value,
            kv.key.view(kv_cache.dtype),
            kv.value.view(kv_cache.dtype),
            slot_mapping,
            self.kv_cache_dtype,
            layer._k_scale,
            layer._v_scale,
        )

    # --- fusion-pass hooks: the fused prologue for models that do not wire
    # HpcRopeNorm themselves ---------------------------------------------

    def fused_qk_norm_rope_kvcache_supported(self) -> bool:
        # The layer's shape and cache dtype were checked in __init__; the
        # kernel covers every configuration this impl accepts.
        return has_hpc_kernels()

    def fused_rope_kvcache_supported(self) -> bool:
        return has_hpc_kernels()

    def do_qk_norm_rope_kvcache_update(
        self,
        layer: AttentionLayer,
        qkv: torch.Tensor,
        q_out: torch.Tensor,
        k_out: torch.Tensor,
        positions: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        rms_norm_eps: float,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
        kv_cache: torch.Tensor,
        layer_slot_mapping: torch.Tensor,
    ) -> None:
        """Per-head RMSNorm then RoPE of Q and K, K/V written into the cache,
        Q into ``q_out``, in one launch of the prologue kernel.

        ``k_out`` is left as it is: the kernel writes the normed, rotated K
        into the cache only, and ``forward`` reads K from the cache.
        """
        run_prologue(
            layer,
            kv_cache,
            self.head_size,
            self.use_fp8,
            qkv,
            positions,
            layer_slot_mapping,
            cos_sin_cache,
            q_out.view(qkv.shape[0], self.num_heads, self.head_size),
            norm_policy=QkNormPolicy.NORM_THEN_ROPE,
            is_neox=is_neox,
            q_norm_weight=q_weight,
            k_norm_weight=k_weight,
            eps=rms_norm_eps,
        )

    def do_rope_and_kv_cache_update(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
        kv_cache: torch.Tensor,
        layer_slot_mapping: torch.Tensor,
    ) -> None:
        """RoPE of Q (in place) and K, K/V written into the cache, in one
        launch of the prologue kernel.

        The kernel reads one packed [T, (Hq + 2 Hkv) D] row per token: the
        projection's output itself when the three inputs are its adjacent
        slices, else a packed copy. ``key`` is left as it is: the rotated
        K goes into the cache only, and ``forward`` reads K from the cache.
        """
        num_tokens = query.shape[0]
        qkv = _packed_qkv(query, key, value)
        q_shape = (num_tokens, self.num_heads, self.head_size)
        q_out = (
            query.view(q_shape) if query.is_contiguous() else query.new_empty(q_shape)
        )
        run_prologue(
            layer,
            kv_cache,
            self.head_size,
            self.use_fp8,
            qkv,
            positions,
            layer_slot_mapping,
            cos_sin_cache,
            q_out,
            norm_policy=QkNormPolicy.NONE,
            is_neox=is_neox,
        )
        if q_out.data_ptr() != query.data_ptr():
            query.copy_(q_out.view(query.shape))


def _packed_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    """[T, (Hq + 2 Hkv) D] rows of Q, K and V: a view when they are adjacent
    slices of one buffer with one row stride (how models split the QKV
    projection), so the hook copies nothing; else a packed copy."""
    num_tokens = query.shape[0]
    parts = [x.reshape(num_tokens, -1) for x in (query, key, value)]
    width = sum(x.shape[1] for x in parts)
    row_stride = parts[0].stride(0) if num_tokens > 1 else width
    adjacent = all(x.stride(1) == 1 for x in parts) and all(
        (num_tokens <= 1 or b.stride(0) == row_stride)
        and b.data_ptr() == a.data_ptr() + a.shape[1] * a.element_size()
        and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        for a, b in itertools.pairwise(parts)
    )
    if adjacent and row_stride >= width:
        return parts[0].as_strided((num_tokens, width), (row_stride, 1))
    return torch.cat(parts, dim=-1)
