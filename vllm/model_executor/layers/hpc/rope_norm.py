# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused attention prologue on the in-tree HPC kernels.

``HpcRopeNorm`` applies the optional per-head QK-RMSNorm and RoPE to a packed
QKV projection, writes K and V into the layer's paged KV cache and returns Q
(bfloat16/float16, or FP8-E4M3 with per-token-per-head scales when the KV
cache is FP8). The layer keeps the model's side (norm weights, RoPE cache,
configuration checks); the launch is the attention backend's prologue entry
(``hpc_attn.run_prologue``, ``_hpc_C::rope_norm_store_kv``), which the
backend's fusion-pass hooks share.

Model code uses ``HpcRopeNorm``, ``QkNormPolicy`` and the
``vllm::hpc_rope_norm_forward`` splitting op, then call the attention layer
with ``key=None, value=None``: K and V are in the cache already (vLLM's
bypass of its KV-cache write). FP8 Q scales are handed to the attention
backend through ``HpcAttnMetadata`` fields (``hpc_decode_q_scale``,
``hpc_prefill_q_scale``).

* One kernel launch covers the whole batch: every token carries its own
  position and KV-cache slot, so decode and prefill tokens need no separate
  launches.
* K and V are written straight into the paged cache through the strides of
  the cache views, whatever the page layout (the backend's pages interleave
  K and V): no scratch pages, no separate scatter pass.
* The unused tail of each request's last KV block is left as it is: the
  attention kernels mask keys by sequence length, so slots past ``seq_len``
  are never read.
* Token positions are ``attn_metadata.positions``: the model runner's, or
  derived by the attention builder once per step when it gives none.
* FP8 Q scales live in the attention builder's persistent
  ``[max_num_batched_tokens, num_heads]`` float32 buffer
  (``hpc_q_scale_buffer``), shared by all layers: each layer's attention
  consumes its scales before the next layer's prologue runs. The decode and
  prefill rows are handed off as ``hpc_decode_q_scale`` and
  ``hpc_prefill_q_scale``.

The hand-off fields are declared on ``HpcAttnMetadata``. Each prologue writes
all of them; the attention of the same layer reads them and resets them, and
the builder starts every step with fresh metadata, so no value reaches another
layer or step. The op runs eagerly between piecewise CUDA graphs, is captured
together with the attention in FULL graphs (the hand-off is then resolved at
capture), and is an eager break under ``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, so
that it and the attention both run at replay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from vllm._hpc_ops import (
    MAX_GQA_RATIO,
    SUPPORTED_HEAD_SIZES,
    QkNormPolicy,
)
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import get_current_vllm_config_or_none
from vllm.forward_context import ForwardContext, get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.hpc.hpc_module import HpcModule
from vllm.utils.hpc import has_hpc_kernels
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.hpc_attn import run_prologue
from vllm.v1.attention.backends.registry import AttentionBackendEnum

if TYPE_CHECKING:
    from vllm.v1.attention.backends.hpc_attn import HpcAttnMetadata

logger = init_logger(__name__)

__all__ = [
    "HpcRopeNorm",
    "QkNormPolicy",
    "ROPE_NORM_KERNEL",
    "hpc_rope_norm_forward",
]

ROPE_NORM_KERNEL = "_hpc_C::rope_norm_store_kv"
"""The kernel this layer launches (one launch per layer and step)."""

SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3")
_FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_NORM_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MODEL_DTYPES = (torch.bfloat16, torch.float16)
_EXPLICIT_16BIT_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_hpc_rope_norm_instances: dict[str, HpcRopeNorm] = {}
# FP8 Q-scale buffers shared by every layer, by (device, rows, num_heads).


# ---------------------------------------------------------------------------
# Splitting custom op
# ---------------------------------------------------------------------------


@eager_break_during_capture
def hpc_rope_norm_forward(
    qkv: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """QK-Norm + RoPE + KV-cache write (+ FP8 Q quantisation) for one layer.

    Writes the processed Q into ``output``. Registered as
    ``vllm::hpc_rope_norm_forward``, a graph splitting op, so its body is
    opaque to torch.compile. Under a breakable CUDA graph it is an eager
    break, like the attention op: its hand-off to the attention backend is
    Python state on the step's metadata, which a captured launch would not
    set again at replay.
    """
    forward_context: ForwardContext = get_forward_context()
    attn_metadata: Any = forward_context.attn_metadata
    if isinstance(attn_metadata, dict):
        attn_metadata = attn_metadata[layer_name]
    elif isinstance(attn_metadata, list):
        # Speculative decoding: entry 0 is the target model's metadata.
        attn_metadata = attn_metadata[0][layer_name]

    # The FP8 Q-scale buffer belongs to the attention builder (the metadata's
    # hpc_q_scale_buffer); nothing is allocated here on the profiling run.
    rope_norm = _hpc_rope_norm_instances[layer_name]
    if attn_metadata is None:
        output.zero_()
        return

    attn_layer = forward_context.no_compile_layers[layer_name]
    kv_cache = attn_layer.kv_cache
    if kv_cache.numel() == 0:
        output.zero_()
        return

    rope_norm._forward_impl(qkv, kv_cache, attn_metadata, attn_layer, output)


def _hpc_rope_norm_forward_fake(
    qkv: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    # ``output`` is mutated in place; nothing is returned.
    return None


direct_register_custom_op(
    op_name="hpc_rope_norm_forward",
    op_func=hpc_rope_norm_forward,
    mutates_args=["output"],
    fake_impl=_hpc_rope_norm_forward_fake,
)


# ---------------------------------------------------------------------------
# Layer
# ---------------------------------------------------------------------------


def _norm_eps(norm: torch.nn.Module, name: str) -> float:
    for attr in ("variance_epsilon", "eps"):
        eps = getattr(norm, attr, None)
        if eps is not None:
            return float(eps)
    raise ValueError(f"{name} ({type(norm).__name__}) exposes no epsilon")


def _check_norm(norm: torch.nn.Module, name: str, head_dim: int) -> None:
    if not getattr(norm, "has_weight", True):
        raise ValueError(f"{name} has no weight; the fused kernel needs one")
    if getattr(norm, "variance_size_override", None) is not None:
        raise ValueError(
            f"{name} normalises over a partial head; the fused kernel normalises "
            "over the whole head"
        )
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name} has no weight tensor")
    if tuple(weight.shape) != (head_dim,):
        raise ValueError(
            f"{name}.weight has shape {tuple(weight.shape)}; expected ({head_dim},)"
        )
    if weight.dtype not in _NORM_WEIGHT_DTYPES:
        raise ValueError(
            f"{name}.weight has dtype {weight.dtype}; accepted: float32, "
            "bfloat16, float16"
        )


@CustomOp.register("hpc_rope_norm")
class HpcRopeNorm(CustomOp, HpcModule):
    """Fused QK-RMSNorm + RoPE + KV-cache write (+ FP8 Q quantisation).

    Owned by a model's attention module, e.g. HunYuan V3. The QK-Norm weights
    and epsilon are read from the model's own norm modules (``fallback_qnorm``
    and ``fallback_knorm``, float32 or model dtype), so no copy is kept.

    ``forward(qkv, layer_name)`` returns Q as ``[num_tokens, num_heads,
    head_dim]`` and has written K/V into the cache of attention layer
    ``layer_name``. Both ``forward_cuda`` and ``forward_native`` call the
    ``vllm::hpc_rope_norm_forward`` splitting op; CUDA graphs can still
    capture its single kernel launch.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cos_sin_cache: torch.Tensor,
        use_qk_norm: bool,
        fallback_qnorm: torch.nn.Module | None,
        fallback_knorm: torch.nn.Module | None,
        kv_cache_dtype: str,
        layer_name: str,
        qk_norm_policy: QkNormPolicy = QkNormPolicy.ROPE_THEN_NORM,
        *,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        if not has_hpc_kernels():
            raise ImportError(
                "HpcRopeNorm needs the vllm._hpc_C kernel library, which is not "
                "built or failed to load. Build it, or select an attention "
                "backend other than HPC_ATTN."
            )

        reason = self._shape_unsupported_reason(num_heads, num_kv_heads, head_dim)
        if reason is not None:
            raise ValueError(f"HpcRopeNorm: {reason}")
        if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(
                f"HpcRopeNorm: kv_cache_dtype {kv_cache_dtype!r} is not "
                f"supported; accepted: {SUPPORTED_KV_CACHE_DTYPES}"
            )

        if cos_sin_cache.dim() != 2:
            raise ValueError(
                "HpcRopeNorm: cos_sin_cache must be [max_position, rotary_dim], "
                f"got shape {tuple(cos_sin_cache.shape)}"
            )
        rotary_dim = cos_sin_cache.shape[1]
        if rotary_dim % 16 != 0 or not 16 <= rotary_dim <= head_dim:
            raise ValueError(
                f"HpcRopeNorm: rotary dim (cos_sin_cache.shape[1]) is "
                f"{rotary_dim}; the kernel needs a multiple of 16 in "
                f"[16, head_dim = {head_dim}]"
            )

        self.qk_norm_policy = (
            QkNormPolicy(qk_norm_policy) if use_qk_norm else QkNormPolicy.NONE
        )
        self.eps = 1e-6
        if self.qk_norm_policy != QkNormPolicy.NONE:
            if fallback_qnorm is None or fallback_knorm is None:
                raise ValueError(
                    "HpcRopeNorm: QK-Norm is enabled but fallback_qnorm/"
                    "fallback_knorm were not supplied; the fused kernel reads "
                    "their weights directly."
                )
            _check_norm(fallback_qnorm, "fallback_qnorm", head_dim)
            _check_norm(fallback_knorm, "fallback_knorm", head_dim)
            if fallback_qnorm.weight.dtype != fallback_knorm.weight.dtype:
                raise ValueError(
                    "HpcRopeNorm: fallback_qnorm and fallback_knorm weights "
                    f"differ in dtype ({fallback_qnorm.weight.dtype} vs "
                    f"{fallback_knorm.weight.dtype})"
                )
            q_eps = _norm_eps(fallback_qnorm, "fallback_qnorm")
            k_eps = _norm_eps(fallback_knorm, "fallback_knorm")
            if q_eps != k_eps:
                raise ValueError(
                    "HpcRopeNorm: the kernel takes one epsilon, but "
                    f"fallback_qnorm has {q_eps} and fallback_knorm {k_eps}"
                )
            if not q_eps > 0.0:
                raise ValueError(f"HpcRopeNorm: norm epsilon must be > 0, got {q_eps}")
            self.eps = q_eps

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.head_per_group = num_heads // num_kv_heads
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        self.kv_cache_dtype = kv_cache_dtype
        self.use_fp8 = kv_cache_dtype in _FP8_KV_CACHE_DTYPES

        # Non-persistent: moves with the module and takes part in sleep-mode
        # save/restore, but stays out of the checkpoint state_dict.
        self.register_buffer(
            "cos_sin_cache", cos_sin_cache.float().contiguous(), persistent=False
        )
        self.fallback_qnorm = fallback_qnorm
        self.fallback_knorm = fallback_knorm

        # FP8 Q scales: one [rows, num_heads] float32 buffer, allocated on
        # first use on the device of the activations.

        self.layer_name: str | None = None
        self.register_layer_name(layer_name)

    # -- support -------------------------------------------------------------

    @staticmethod
    def _shape_unsupported_reason(
        num_heads: int, num_kv_heads: int, head_dim: int
    ) -> str | None:
        if head_dim not in SUPPORTED_HEAD_SIZES:
            return f"head_dim {head_dim} is not one of {SUPPORTED_HEAD_SIZES}"
        if num_heads <= 0 or num_kv_heads <= 0:
            return (
                f"num_heads ({num_heads}) and num_kv_heads ({num_kv_heads}) "
                "must be positive"
            )
        if num_heads % num_kv_heads != 0:
            return (
                f"num_heads ({num_heads}) is not a multiple of num_kv_heads "
                f"({num_kv_heads})"
            )
        ratio = num_heads // num_kv_heads
        if ratio > MAX_GQA_RATIO:
            return (
                f"num_heads / num_kv_heads = {ratio} exceeds the kernel's "
                f"maximum of {MAX_GQA_RATIO}"
            )
        return None

    @classmethod
    def unsupported_reason(
        cls,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_cache_dtype: str,
    ) -> str | None:
        """Why the fused path cannot be used for this config, or ``None``.

        Rotary-dim and QK-Norm details are checked by the constructor.
        """
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None:
            return "no vLLM config is set"
        backend = vllm_config.attention_config.backend
        if backend != AttentionBackendEnum.HPC_ATTN:
            name = backend.name if backend is not None else "auto"
            return f"attention backend is {name}, not HPC_ATTN"
        if not has_hpc_kernels():
            return "the vllm._hpc_C kernel library is not available"
        if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            return (
                f"kv_cache_dtype {kv_cache_dtype!r} is not one of "
                f"{SUPPORTED_KV_CACHE_DTYPES}"
            )
        model_config = vllm_config.model_config
        if model_config is not None:
            model_dtype = model_config.dtype
            if model_dtype not in _MODEL_DTYPES:
                return f"model dtype {model_dtype} is not bfloat16 or float16"
            cache_dtype = _EXPLICIT_16BIT_CACHE_DTYPES.get(kv_cache_dtype)
            if cache_dtype is not None and cache_dtype != model_dtype:
                return (
                    f"kv_cache_dtype {kv_cache_dtype!r} differs from the model "
                    f"dtype {model_dtype}"
                )
        return cls._shape_unsupported_reason(num_heads, num_kv_heads, head_dim)

    @classmethod
    def support(
        cls,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_cache_dtype: str,
    ) -> bool:
        """Whether the fused path can be used for this config.

        Requires the HPC_ATTN attention backend to be selected in the current
        vLLM config. Logs the reason when the backend is selected but the
        config is not covered.
        """
        reason = cls.unsupported_reason(
            num_heads, num_kv_heads, head_dim, kv_cache_dtype
        )
        if reason is None:
            logger.info_once("HpcRopeNorm: fused RoPE/QK-Norm/KV-write enabled.")
            return True
        vllm_config = get_current_vllm_config_or_none()
        if (
            vllm_config is not None
            and vllm_config.attention_config.backend == AttentionBackendEnum.HPC_ATTN
        ):
            logger.warning_once("HpcRopeNorm disabled: %s.", reason)
        else:
            # Not asked for: nothing worth a warning.
            logger.debug_once("HpcRopeNorm disabled: %s.", reason)
        return False

    def register_layer_name(self, layer_name: str) -> None:
        """Bind this module to attention layer ``layer_name``.

        The custom op is a module-level function; it finds this instance
        through the registry filled here.
        """
        self.layer_name = layer_name
        _hpc_rope_norm_instances[layer_name] = self
        logger.debug("HpcRopeNorm registered for layer %s", layer_name)

    # -- forward -------------------------------------------------------------

    def forward_native(self, qkv: torch.Tensor, layer_name: str) -> torch.Tensor:
        """Same as ``forward_cuda``: the op is the only implementation."""
        return self.forward_cuda(qkv, layer_name)

    def forward_cuda(self, qkv: torch.Tensor, layer_name: str) -> torch.Tensor:
        """Run the splitting op and return Q as ``[T, num_heads, head_dim]``."""
        output = torch.empty(
            (qkv.shape[0], self.num_heads, self.head_dim),
            dtype=torch.float8_e4m3fn if self.use_fp8 else qkv.dtype,
            device=qkv.device,
        )
        torch.ops.vllm.hpc_rope_norm_forward(qkv, output, layer_name)
        return output

    def _step_q_scale(
        self, attn_metadata: HpcAttnMetadata, num_tokens: int, device: torch.device
    ) -> torch.Tensor:
        """``[num_tokens, num_heads]`` rows of the attention builder's FP8
        Q-scale buffer (``hpc_q_scale_buffer``, the only one) for this step."""
        buf = getattr(attn_metadata, "hpc_q_scale_buffer", None)
        if (
            buf is None
            or buf.device != device
            or buf.shape[0] < num_tokens
            or buf.shape[1] != self.num_heads
        ):
            got = None if buf is None else (tuple(buf.shape), str(buf.device))
            raise RuntimeError(
                "HpcRopeNorm: FP8 queries need the HPC_ATTN builder's Q-scale "
                f"buffer (attn_metadata.hpc_q_scale_buffer) of at least "
                f"{num_tokens} x {self.num_heads} rows on {device}, got {got}"
            )
        return buf[:num_tokens]

    def _forward_impl(
        self,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: HpcAttnMetadata,
        attn_layer: torch.nn.Module,
        output: torch.Tensor,
    ) -> None:
        """Launch the fused kernel once for every token of the batch.

        Writes Q into ``output`` and K/V into ``kv_cache``, then records the
        hand-off on ``attn_metadata`` for the attention backend.
        """
        num_tokens = attn_metadata.num_actual_tokens
        num_decode_tokens = attn_metadata.num_decode_tokens

        positions = attn_metadata.positions
        if positions is None:
            raise ValueError(
                "HpcRopeNorm: the attention metadata has no positions (the "
                "HPC_ATTN builder derives them when the model runner gives none)"
            )

        q_scale: torch.Tensor | None = None
        if output.dtype == torch.float8_e4m3fn:
            q_scale = self._step_q_scale(attn_metadata, num_tokens, qkv.device)

        q_norm_weight: torch.Tensor | None = None
        k_norm_weight: torch.Tensor | None = None
        if self.qk_norm_policy != QkNormPolicy.NONE:
            assert self.fallback_qnorm is not None
            assert self.fallback_knorm is not None
            q_norm_weight = cast(torch.Tensor, self.fallback_qnorm.weight)
            k_norm_weight = cast(torch.Tensor, self.fallback_knorm.weight)

        run_prologue(
            attn_layer,
            kv_cache,
            self.head_dim,
            self.use_fp8,
            qkv[:num_tokens],
            positions,
            attn_metadata.slot_mapping,
            cast(torch.Tensor, self.cos_sin_cache),
            output[:num_tokens],
            norm_policy=self.qk_norm_policy,
            is_neox=self.is_neox_style,
            q_scale=q_scale,
            q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight,
            eps=self.eps,
        )

        # Every hand-off field is written, so nothing of another layer's
        # prologue survives even if its attention did not consume it.
        attn_metadata.hpc_decode_q_scale = (
            q_scale[:num_decode_tokens]
            if q_scale is not None and attn_metadata.num_decodes > 0
            else None
        )
        attn_metadata.hpc_prefill_q_scale = (
            q_scale[num_decode_tokens:]
            if q_scale is not None and attn_metadata.num_prefills > 0
            else None
        )
