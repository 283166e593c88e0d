# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of the HpcRopeNorm layer and vllm.utils.hpc in a patched vLLM.

They need vLLM 0.33.0 with this patch set applied and skip otherwise. The
fused kernel itself is never launched: where the layer would call it, a
recording stand-in checks what it is handed.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import sys
import types
from typing import Any

import pytest
import torch

from vllm import _hpc_ops
from vllm.config import (
    AttentionConfig,
    DeviceConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.forward_context import (
    ForwardContext,
    override_forward_context,
)
from vllm.model_executor.custom_op import CustomOp, op_registry
from vllm.model_executor.layers.hpc import HpcModule, rope_norm
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.utils import hpc as hpc_utils
from vllm.v1.attention.backends import hpc_attn
from vllm.v1.attention.backends.hpc_attn import HpcAttnMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum

HpcRopeNorm = rope_norm.HpcRopeNorm
QkNormPolicy = rope_norm.QkNormPolicy
FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------


def _make_config(backend: AttentionBackendEnum | None) -> VllmConfig:
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        attention_config=AttentionConfig(backend=backend),
    )


@pytest.fixture
def hpc_config(monkeypatch: pytest.MonkeyPatch):
    """HPC_ATTN selected, the kernel library reported as available."""
    monkeypatch.setattr(rope_norm, "has_hpc_kernels", lambda: True)
    config = _make_config(AttentionBackendEnum.HPC_ATTN)
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def clean_has_hpc():
    hpc_utils.has_hpc.cache_clear()
    hpc_utils.has_hpc_kernels.cache_clear()
    yield
    hpc_utils.has_hpc.cache_clear()
    hpc_utils.has_hpc_kernels.cache_clear()


class _RecordingLogger:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning_once(self, msg: str, *args: object, **kwargs: object) -> None:
        self.warnings.append(msg % args if args else msg)

    def info_once(self, *args: object, **kwargs: object) -> None:
        pass

    def debug_once(self, *args: object, **kwargs: object) -> None:
        pass

    def debug(self, *args: object, **kwargs: object) -> None:
        pass


def _cos_sin(max_pos: int, rotary_dim: int) -> torch.Tensor:
    return torch.randn(max_pos, rotary_dim, dtype=torch.float32)


def _norm(head_dim: int, eps: float = 1e-5, dtype=torch.float32) -> RMSNorm:
    return RMSNorm(head_dim, eps, dtype=dtype)


def _layer(
    *,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    rotary_dim: int | None = None,
    kv_cache_dtype: str = "auto",
    use_qk_norm: bool = True,
    layer_name: str = "model.layers.0.self_attn.attn",
    **kwargs,
) -> HpcRopeNorm:
    return HpcRopeNorm(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        cos_sin_cache=_cos_sin(128, rotary_dim or head_dim),
        use_qk_norm=use_qk_norm,
        fallback_qnorm=_norm(head_dim) if use_qk_norm else None,
        fallback_knorm=_norm(head_dim) if use_qk_norm else None,
        kv_cache_dtype=kv_cache_dtype,
        layer_name=layer_name,
        qk_norm_policy=QkNormPolicy.NORM_THEN_ROPE,
        **kwargs,
    )


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def test_registered_as_custom_op():
    assert op_registry["hpc_rope_norm"] is HpcRopeNorm
    # CustomOp.register names the class itself.
    assert vars(HpcRopeNorm)["name"] == "hpc_rope_norm"
    assert issubclass(HpcRopeNorm, CustomOp)
    assert issubclass(HpcRopeNorm, HpcModule)
    # The package re-exports this implementation, not another one.
    hpc_pkg = importlib.import_module("vllm.model_executor.layers.hpc")
    assert hpc_pkg.HpcRopeNorm is HpcRopeNorm
    assert hpc_pkg.QkNormPolicy is _hpc_ops.QkNormPolicy


def test_qk_norm_policy_values():
    assert QkNormPolicy is _hpc_ops.QkNormPolicy
    assert {p.name: int(p) for p in QkNormPolicy} == {
        "NONE": 0,
        "ROPE_THEN_NORM": 1,
        "NORM_THEN_ROPE": 2,
    }


def test_custom_op_schema_mutates_only_output():
    op = torch.ops.vllm.hpc_rope_norm_forward.default
    args = {a.name: a for a in op._schema.arguments}
    assert list(args) == ["qkv", "output", "layer_name"]
    assert args["output"].alias_info is not None
    assert args["output"].alias_info.is_write
    assert args["qkv"].alias_info is None
    assert len(op._schema.returns) == 0


def test_custom_op_fake_impl_under_fake_tensor_mode():
    from torch._library.simple_registry import singleton
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    # Registered explicitly rather than left to torch's trivial fallback.
    entry = singleton.find("vllm::hpc_rope_norm_forward")
    assert entry.fake_impl.kernel is not None

    # No forward context is set: running the real implementation would fail,
    # so success means the fake implementation was used.
    with FakeTensorMode():
        qkv = torch.empty(5, (8 + 2 * 2) * 64, dtype=torch.bfloat16)
        out = torch.empty(5, 8, 64, dtype=FP8)
        result = torch.ops.vllm.hpc_rope_norm_forward(qkv, out, "no.such.layer")
        assert result is None
        assert isinstance(out, FakeTensor)
        assert out.shape == (5, 8, 64)
        assert out.dtype == FP8


def test_splitting_op_is_listed_in_compilation_config():
    from vllm.config.compilation import CompilationConfig

    assert "vllm::hpc_rope_norm_forward" in CompilationConfig._attention_ops


def test_hy_v3_imports_against_patched_tree():
    hy_v3 = importlib.import_module("vllm.model_executor.models.hy_v3")
    assert hy_v3.HpcRopeNorm is HpcRopeNorm
    assert hy_v3.QkNormPolicy.NORM_THEN_ROPE == 2


def test_hpc_attn_metadata_has_handoff_fields():
    names = {f.name for f in dataclasses.fields(HpcAttnMetadata)}
    used = {
        "num_actual_tokens",
        "num_decodes",
        "num_decode_tokens",
        "num_prefills",
        "slot_mapping",
        "seq_lens",
        "qo_indptr",
        "qo_indptr_decode",
        "decode_query_len",
        "hpc_decode_q_scale",
        "hpc_prefill_q_scale",
    }
    assert used <= names, sorted(used - names)


# ---------------------------------------------------------------------------
# support()
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,kv_cache_dtype",
    [
        (64, 8, 128, "auto"),
        (32, 4, 128, "bfloat16"),
        (32, 4, 128, "float16"),
        (16, 1, 256, "fp8_e4m3"),
        (32, 2, 64, "fp8"),  # ratio 16, the maximum
        (8, 8, 128, "auto"),  # ratio 1
    ],
)
def test_support_accepts(hpc_config, num_heads, num_kv_heads, head_dim, kv_cache_dtype):
    assert (
        HpcRopeNorm.unsupported_reason(
            num_heads, num_kv_heads, head_dim, kv_cache_dtype
        )
        is None
    )
    assert HpcRopeNorm.support(num_heads, num_kv_heads, head_dim, kv_cache_dtype)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,kv_cache_dtype,needle",
    [
        (64, 8, 96, "auto", "96"),
        (64, 2, 128, "auto", "32"),  # ratio 32
        (64, 8, 128, "fp8_e5m2", "fp8_e5m2"),
        (12, 8, 128, "auto", "multiple"),
        (64, 8, 128, "int8", "int8"),
    ],
)
def test_support_declines_with_reason(
    hpc_config, monkeypatch, num_heads, num_kv_heads, head_dim, kv_cache_dtype, needle
):
    log = _RecordingLogger()
    monkeypatch.setattr(rope_norm, "logger", log)
    reason = HpcRopeNorm.unsupported_reason(
        num_heads, num_kv_heads, head_dim, kv_cache_dtype
    )
    assert reason is not None and needle in reason
    assert not HpcRopeNorm.support(num_heads, num_kv_heads, head_dim, kv_cache_dtype)
    # HPC_ATTN was asked for, so the refusal is a warning.
    assert any(needle in w for w in log.warnings), log.warnings


def test_support_declines_without_library(hpc_config, monkeypatch):
    monkeypatch.setattr(rope_norm, "has_hpc_kernels", lambda: False)
    reason = HpcRopeNorm.unsupported_reason(64, 8, 128, "auto")
    assert reason is not None and "_hpc_C" in reason
    assert not HpcRopeNorm.support(64, 8, 128, "auto")


@pytest.mark.parametrize("backend", [AttentionBackendEnum.FLASH_ATTN, None])
def test_support_declines_other_backend(monkeypatch, backend):
    monkeypatch.setattr(rope_norm, "has_hpc_kernels", lambda: True)
    log = _RecordingLogger()
    monkeypatch.setattr(rope_norm, "logger", log)
    with set_current_vllm_config(_make_config(backend)):
        reason = HpcRopeNorm.unsupported_reason(64, 8, 128, "auto")
        assert reason is not None and "HPC_ATTN" in reason
        assert not HpcRopeNorm.support(64, 8, 128, "auto")
    # Not asked for: no warning.
    assert log.warnings == []


def test_support_declines_without_config(monkeypatch):
    monkeypatch.setattr(rope_norm, "has_hpc_kernels", lambda: True)
    monkeypatch.setattr(rope_norm, "get_current_vllm_config_or_none", lambda: None)
    assert not HpcRopeNorm.support(64, 8, 128, "auto")


@pytest.mark.parametrize(
    "model_dtype,kv_cache_dtype,ok",
    [
        (torch.bfloat16, "auto", True),
        (torch.bfloat16, "bfloat16", True),
        (torch.bfloat16, "float16", False),
        (torch.float16, "float16", True),
        (torch.float16, "bfloat16", False),
        (torch.float16, "fp8_e4m3", True),
        (torch.float32, "auto", False),
    ],
)
def test_support_checks_model_dtype(monkeypatch, model_dtype, kv_cache_dtype, ok):
    config = types.SimpleNamespace(
        attention_config=types.SimpleNamespace(backend=AttentionBackendEnum.HPC_ATTN),
        model_config=types.SimpleNamespace(dtype=model_dtype),
    )
    monkeypatch.setattr(rope_norm, "has_hpc_kernels", lambda: True)
    monkeypatch.setattr(rope_norm, "get_current_vllm_config_or_none", lambda: config)
    assert HpcRopeNorm.support(64, 8, 128, kv_cache_dtype) is ok


# ---------------------------------------------------------------------------
# has_hpc_kernels() (the in-tree library) and has_hpc() (the external package)
# ---------------------------------------------------------------------------


def test_has_hpc_kernels_follows_library(clean_has_hpc, monkeypatch):
    assert hpc_utils.has_hpc_kernels() is _hpc_ops.hpc_ops_available()

    monkeypatch.setattr(_hpc_ops, "hpc_ops_available", lambda: False)
    hpc_utils.has_hpc_kernels.cache_clear()
    assert hpc_utils.has_hpc_kernels() is False

    monkeypatch.setattr(_hpc_ops, "hpc_ops_available", lambda: True)
    hpc_utils.has_hpc_kernels.cache_clear()
    assert hpc_utils.has_hpc_kernels() is True


def test_has_hpc_kernels_false_without_op_layer(clean_has_hpc, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm._hpc_ops", None)
    assert hpc_utils.has_hpc_kernels() is False


def _external_hpc_package(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    """The external ``hpc`` package as importlib finds it: installed or not."""
    if installed:
        module = types.ModuleType("hpc")
        module.__spec__ = importlib.machinery.ModuleSpec("hpc", None)
        monkeypatch.setitem(sys.modules, "hpc", module)
    else:
        monkeypatch.setitem(sys.modules, "hpc", None)


@pytest.mark.parametrize("installed", [False, True])
def test_has_hpc_means_the_external_package(clean_has_hpc, monkeypatch, installed):
    """has_hpc() keeps its upstream meaning: the separately installed
    package, whatever the in-tree library's state."""
    _external_hpc_package(monkeypatch, installed)
    monkeypatch.setattr(_hpc_ops, "hpc_ops_available", lambda: not installed)
    assert hpc_utils.has_hpc() is installed
    assert hpc_utils.has_hpc_kernels() is (not installed)


def _metadata(**overrides: Any) -> HpcAttnMetadata:
    # Two single-token decodes (seq_lens 5, 9) and one prefill of 3 tokens
    # after 2 cached ones (seq_len 5): 5 tokens in all.
    fields: dict[str, Any] = dict(
        num_actual_tokens=5,
        num_decodes=2,
        num_decode_tokens=2,
        num_prefills=1,
        num_prefill_tokens=3,
        max_query_len=3,
        max_seq_len=9,
        slot_mapping=torch.tensor([10, 20, 30, 31, 32], dtype=torch.int64),
        seq_lens=torch.tensor([5, 9, 5], dtype=torch.int32),
        block_table_tensor=torch.zeros(3, 4, dtype=torch.int32),
        qo_indptr=torch.tensor([0, 3], dtype=torch.int32),
        qo_indptr_decode=torch.tensor([0, 1, 2], dtype=torch.int32),
        decode_query_len=1,
        hpc_prefill_q_scale=None,
        hpc_decode_q_scale=None,
        # The builder's FP8 Q-scale buffer, for layers of 8 query heads.
        hpc_q_scale_buffer=torch.zeros(64, 8, dtype=torch.float32),
        # The builder's positions (derive_positions of the batch above).
        positions=torch.tensor([4, 8, 2, 3, 4], dtype=torch.int64),
    )
    fields.update(overrides)
    return HpcAttnMetadata(**fields)


# ---------------------------------------------------------------------------
# Constructor
# ---------------------------------------------------------------------------


def test_constructor_requires_library(monkeypatch):
    monkeypatch.setattr(rope_norm, "has_hpc_kernels", lambda: False)
    with (
        set_current_vllm_config(_make_config(AttentionBackendEnum.HPC_ATTN)),
        pytest.raises(ImportError, match="_hpc_C"),
    ):
        _layer()


def test_constructor_reads_config(hpc_config):
    layer = _layer(
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        rotary_dim=64,
        kv_cache_dtype="fp8_e4m3",
        layer_name="test.ctor.attn",
    )
    assert layer.use_fp8
    assert layer.rotary_dim == 64
    assert layer.is_neox_style is True
    assert layer.eps == 1e-5
    assert layer.head_per_group == 4
    assert layer.q_size == 8 * 128 and layer.kv_size == 2 * 128
    assert layer.qk_norm_policy == QkNormPolicy.NORM_THEN_ROPE
    assert layer.cos_sin_cache.dtype == torch.float32
    assert layer.cos_sin_cache.shape == (128, 64)
    assert "cos_sin_cache" in dict(layer.named_buffers())
    assert "cos_sin_cache" not in layer.state_dict()
    assert layer.layer_name == "test.ctor.attn"
    assert rope_norm._hpc_rope_norm_instances["test.ctor.attn"] is layer


def test_constructor_variants(hpc_config):
    plain = _layer(use_qk_norm=False, kv_cache_dtype="auto", is_neox_style=False)
    assert not plain.use_fp8
    assert plain.is_neox_style is False
    assert plain.qk_norm_policy == QkNormPolicy.NONE
    assert plain.fallback_qnorm is None

    # Model-dtype norm weights are accepted too.
    layer = HpcRopeNorm(
        8,
        2,
        64,
        _cos_sin(32, 64),
        True,
        _norm(64, 1e-6, torch.bfloat16),
        _norm(64, 1e-6, torch.bfloat16),
        "fp8",
        "test.variants.attn",
        QkNormPolicy.ROPE_THEN_NORM,
    )
    assert layer.use_fp8
    assert layer.eps == 1e-6
    assert layer.qk_norm_policy == QkNormPolicy.ROPE_THEN_NORM


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(head_dim=96), "head_dim 96"),
        (dict(num_heads=64, num_kv_heads=2), "exceeds"),
        (dict(num_heads=12, num_kv_heads=8), "multiple"),
        (dict(kv_cache_dtype="fp8_e5m2"), "fp8_e5m2"),
        (dict(rotary_dim=24), "rotary dim"),
        (dict(head_dim=64, rotary_dim=128), "rotary dim"),
    ],
)
def test_constructor_rejects(hpc_config, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        _layer(**kwargs)


def test_constructor_rejects_bad_norms(hpc_config):
    cache = _cos_sin(32, 64)

    def build(qnorm, knorm, cos_sin=cache):
        return HpcRopeNorm(
            8,
            2,
            64,
            cos_sin,
            True,
            qnorm,
            knorm,
            "auto",
            "test.bad.attn",
            QkNormPolicy.NORM_THEN_ROPE,
        )

    with pytest.raises(ValueError, match="not supplied"):
        build(None, _norm(64))
    with pytest.raises(ValueError, match=r"shape \(128,\)"):
        build(_norm(128), _norm(128))
    with pytest.raises(ValueError, match="one epsilon"):
        build(_norm(64, 1e-5), _norm(64, 1e-6))
    with pytest.raises(ValueError, match="dtype"):
        build(_norm(64, dtype=torch.float32), _norm(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cos_sin_cache"):
        build(_norm(64), _norm(64), cos_sin=torch.zeros(64))


# ---------------------------------------------------------------------------
# Forward: one kernel call with the right arguments
# ---------------------------------------------------------------------------


class _KernelRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs) -> None:
        self.calls.append((args, kwargs))


def _kv_cache(layer: HpcRopeNorm, fp8: bool) -> torch.Tensor:
    dtype = torch.uint8 if fp8 else torch.bfloat16
    return torch.zeros(4, layer.num_kv_heads, 16, 2 * layer.head_dim, dtype=dtype)


def _attn_layer(kv_cache: torch.Tensor) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        kv_cache=kv_cache,
        _k_scale=torch.tensor(0.5, dtype=torch.float32),
        _v_scale=torch.tensor(0.25, dtype=torch.float32),
    )


def _forward_context(layers: dict[str, Any], attn_metadata: Any) -> ForwardContext:
    """A forward context as vLLM's create_forward_context makes it, which
    takes the metadata untyped: by layer name (a dict, or a list of dicts
    with speculative decoding), or None on the profiling run."""
    return ForwardContext(
        no_compile_layers=layers, attn_metadata=attn_metadata, slot_mapping={}
    )


def _qkv(layer: HpcRopeNorm, num_tokens: int) -> torch.Tensor:
    width = (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim
    return torch.randn(num_tokens, width).to(torch.bfloat16)


def test_forward_impl_fp8_single_launch(hpc_config, monkeypatch):
    kernel = _KernelRecorder()
    monkeypatch.setattr(hpc_attn, "rope_norm_store_kv", kernel)
    layer = _layer(kv_cache_dtype="fp8_e4m3", is_neox_style=False)
    kv_cache = _kv_cache(layer, fp8=True)
    attn = _attn_layer(kv_cache)
    qkv = _qkv(layer, 7)  # 5 real tokens + 2 padding rows
    output = torch.empty(7, layer.num_heads, layer.head_dim, dtype=FP8)
    # The attention builder's persistent Q-scale buffer.
    rows = hpc_config.scheduler_config.max_num_batched_tokens
    buf = torch.zeros(rows, layer.num_heads, dtype=torch.float32)
    md = _metadata(hpc_q_scale_buffer=buf)

    layer._forward_impl(qkv, kv_cache, md, attn, output)

    assert len(kernel.calls) == 1
    args, kw = kernel.calls[0]
    q_in, positions, slots, cos_sin, key, value, q_out = args
    assert q_in.shape[0] == 5 and q_in.data_ptr() == qkv.data_ptr()
    assert positions.tolist() == [4, 8, 2, 3, 4]
    assert slots is md.slot_mapping
    assert cos_sin is layer.cos_sin_cache
    assert key.dtype == value.dtype == FP8
    assert key.shape == (4, 16, layer.num_kv_heads, layer.head_dim)
    assert key.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
    assert value.data_ptr() == key.data_ptr() + layer.head_dim
    assert q_out.shape == (5, layer.num_heads, layer.head_dim)
    assert q_out.data_ptr() == output.data_ptr()

    assert kw["q_scale"].shape == (5, 8) and kw["q_scale"].data_ptr() == buf.data_ptr()
    assert kw["k_scale"].shape == (1,) and kw["k_scale"].item() == 0.5
    assert kw["v_scale"].shape == (1,) and kw["v_scale"].item() == 0.25
    assert layer.fallback_qnorm is not None and layer.fallback_knorm is not None
    assert kw["q_norm_weight"] is layer.fallback_qnorm.weight
    assert kw["k_norm_weight"] is layer.fallback_knorm.weight
    assert kw["eps"] == 1e-5
    assert kw["norm_policy"] == int(QkNormPolicy.NORM_THEN_ROPE)
    assert kw["is_neox"] is False

    assert md.hpc_decode_q_scale is not None and md.hpc_prefill_q_scale is not None
    assert md.hpc_decode_q_scale.shape == (2, 8)
    assert md.hpc_decode_q_scale.data_ptr() == buf.data_ptr()
    assert md.hpc_prefill_q_scale.shape == (3, 8)
    assert md.hpc_prefill_q_scale.data_ptr() == buf[2].data_ptr()

    # The next step's metadata carries the same buffer.
    md2 = _metadata(positions=torch.arange(5), hpc_q_scale_buffer=buf)
    layer._forward_impl(qkv, kv_cache, md2, attn, output)
    assert kernel.calls[1][1]["q_scale"].data_ptr() == buf.data_ptr()
    assert kernel.calls[1][0][1] is md2.positions


def test_forward_impl_decode_only_fp8(hpc_config, monkeypatch):
    kernel = _KernelRecorder()
    monkeypatch.setattr(hpc_attn, "rope_norm_store_kv", kernel)
    layer = _layer(kv_cache_dtype="fp8")
    kv_cache = _kv_cache(layer, fp8=True)
    md = _metadata(
        num_actual_tokens=2,
        num_prefills=0,
        num_prefill_tokens=0,
        qo_indptr=None,
        seq_lens=torch.tensor([5, 9], dtype=torch.int32),
        positions=torch.tensor([4, 8], dtype=torch.int64),
    )
    output = torch.empty(2, layer.num_heads, layer.head_dim, dtype=FP8)
    layer._forward_impl(_qkv(layer, 2), kv_cache, md, _attn_layer(kv_cache), output)
    assert len(kernel.calls) == 1
    assert kernel.calls[0][0][1].tolist() == [4, 8]
    assert md.hpc_decode_q_scale is not None
    assert md.hpc_decode_q_scale.shape == (2, 8)
    assert md.hpc_prefill_q_scale is None


def test_forward_impl_bf16(hpc_config, monkeypatch):
    kernel = _KernelRecorder()
    monkeypatch.setattr(hpc_attn, "rope_norm_store_kv", kernel)
    layer = _layer(kv_cache_dtype="auto", use_qk_norm=False)
    kv_cache = _kv_cache(layer, fp8=False)
    md = _metadata()
    output = torch.empty(5, layer.num_heads, layer.head_dim, dtype=torch.bfloat16)
    layer._forward_impl(_qkv(layer, 5), kv_cache, md, _attn_layer(kv_cache), output)

    assert len(kernel.calls) == 1
    args, kw = kernel.calls[0]
    assert args[4].dtype == torch.bfloat16
    assert kw["q_scale"] is None and kw["k_scale"] is None and kw["v_scale"] is None
    assert kw["q_norm_weight"] is None and kw["k_norm_weight"] is None
    assert kw["norm_policy"] == int(QkNormPolicy.NONE)
    assert kw["is_neox"] is True
    assert md.hpc_decode_q_scale is None and md.hpc_prefill_q_scale is None


# ---------------------------------------------------------------------------
# Through the custom op
# ---------------------------------------------------------------------------


def _op_runs_on_cpu() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        "vllm::hpc_rope_norm_forward", "CPU"
    )


@pytest.mark.skipif(
    not _op_runs_on_cpu(), reason="the op is registered for another device"
)
@pytest.mark.parametrize("wrap", ["dict", "list"])
def test_custom_op_routes_to_layer(hpc_config, monkeypatch, wrap):
    kernel = _KernelRecorder()
    monkeypatch.setattr(hpc_attn, "rope_norm_store_kv", kernel)
    name = f"test.op.{wrap}.attn"
    layer = _layer(kv_cache_dtype="fp8_e4m3", layer_name=name)
    kv_cache = _kv_cache(layer, fp8=True)
    md = _metadata()
    other = _metadata()
    per_layer = {name: md}
    # The list form: entry 0 is the target model's metadata.
    ctx = _forward_context(
        {name: _attn_layer(kv_cache)},
        per_layer if wrap == "dict" else [per_layer, {name: other}],
    )
    with override_forward_context(ctx):
        q = layer.forward_native(_qkv(layer, 5), name)
    assert q.shape == (5, layer.num_heads, layer.head_dim) and q.dtype == FP8
    assert len(kernel.calls) == 1
    assert kernel.calls[0][0][6].data_ptr() == q.data_ptr()
    assert md.hpc_decode_q_scale is not None
    assert other.hpc_decode_q_scale is None


@pytest.mark.skipif(
    not _op_runs_on_cpu(), reason="the op is registered for another device"
)
@pytest.mark.parametrize("case", ["no_metadata", "empty_cache"])
def test_custom_op_zeroes_output_without_work(hpc_config, monkeypatch, case):
    kernel = _KernelRecorder()
    monkeypatch.setattr(hpc_attn, "rope_norm_store_kv", kernel)
    name = f"test.op.{case}.attn"
    layer = _layer(kv_cache_dtype="auto", layer_name=name)
    if case == "no_metadata":
        # vLLM's profiling run has no metadata.
        kv_cache, md = _kv_cache(layer, fp8=False), None
    else:
        kv_cache, md = torch.zeros(0, dtype=torch.bfloat16), _metadata()
    ctx = _forward_context(
        {name: _attn_layer(kv_cache)}, None if md is None else {name: md}
    )
    output = torch.full((5, layer.num_heads, layer.head_dim), 7.0).to(torch.bfloat16)
    with override_forward_context(ctx):
        torch.ops.vllm.hpc_rope_norm_forward(_qkv(layer, 5), output, name)
    assert kernel.calls == []
    assert not output.any()
    if md is not None:
        assert md.hpc_decode_q_scale is None


@pytest.mark.skipif(
    not _op_runs_on_cpu(), reason="the op is registered for another device"
)
def test_profile_run_needs_no_q_scale_buffer(hpc_config):
    # The attention builder owns the FP8 Q-scale buffer; the profiling run
    # (no metadata) returns zeros without one.
    name = "test.op.profile.attn"
    layer = _layer(kv_cache_dtype="fp8_e4m3", layer_name=name)
    ctx = _forward_context({name: _attn_layer(_kv_cache(layer, fp8=True))}, None)
    with override_forward_context(ctx):
        q = layer.forward_native(_qkv(layer, 3), name)
    assert not q.float().any()


def test_forward_impl_uses_metadata_q_scale_buffer(hpc_config, monkeypatch):
    kernel = _KernelRecorder()
    monkeypatch.setattr(hpc_attn, "rope_norm_store_kv", kernel)
    layer = _layer(kv_cache_dtype="fp8_e4m3", layer_name="test.buffer.attn")
    kv_cache = _kv_cache(layer, fp8=True)
    buf = torch.zeros(16, layer.num_heads, dtype=torch.float32)
    md = _metadata(hpc_q_scale_buffer=buf)
    output = torch.empty(5, layer.num_heads, layer.head_dim, dtype=FP8)
    layer._forward_impl(_qkv(layer, 5), kv_cache, md, _attn_layer(kv_cache), output)
    assert kernel.calls[0][1]["q_scale"].data_ptr() == buf.data_ptr()
    assert md.hpc_decode_q_scale is not None and md.hpc_prefill_q_scale is not None
    assert md.hpc_decode_q_scale.data_ptr() == buf.data_ptr()
    assert md.hpc_prefill_q_scale.data_ptr() == buf[2].data_ptr()
    # Without the builder's buffer, or with one of the wrong shape, the
    # prologue refuses (it has no buffer of its own).
    for missing in (None, torch.zeros(16, 3), torch.zeros(4, layer.num_heads)):
        md = _metadata(hpc_q_scale_buffer=missing)
        with pytest.raises(RuntimeError, match="hpc_q_scale_buffer"):
            layer._forward_impl(
                _qkv(layer, 5), kv_cache, md, _attn_layer(kv_cache), output
            )
    assert len(kernel.calls) == 1


def test_forward_impl_refuses_metadata_without_positions(hpc_config, monkeypatch):
    kernel = _KernelRecorder()
    monkeypatch.setattr(hpc_attn, "rope_norm_store_kv", kernel)
    layer = _layer(kv_cache_dtype="auto", layer_name="test.positions.attn")
    kv_cache = _kv_cache(layer, fp8=False)
    md = _metadata(positions=None)
    output = torch.empty(5, layer.num_heads, layer.head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no positions"):
        layer._forward_impl(_qkv(layer, 5), kv_cache, md, _attn_layer(kv_cache), output)
    assert not kernel.calls
