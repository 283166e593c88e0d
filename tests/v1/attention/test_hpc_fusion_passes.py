# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of vLLM's QK-norm+RoPE+KV-cache and RoPE+KV-cache fusion
passes on CUDA, for attention backends that support them (HPC_ATTN).

vLLM 0.33.0's ``PassConfig`` turns both flags off on any platform but ROCm;
with this patch set they stay on for CUDA and ROCm and are still turned off
elsewhere. The configuration runs for real on a CPU that poses as an sm90
GPU; the passes themselves need vLLM's CUDA ops and skip without them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# Imported before the platform is switched, so that the attention layer's
# module does not try to load the CUDA-only flash-attention package.
import vllm
import vllm.config.compilation
import vllm.config.vllm
import vllm.model_executor.layers.attention  # noqa: F401
import vllm.platforms
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    ModelConfig,
    PassConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.config.compilation import CUDAGraphMode
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import (
    Platform,
    PlatformEnum,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum

if TYPE_CHECKING:
    from vllm.platforms.cuda import NonNvmlCudaPlatform

PACKAGE = Path(vllm.__file__).resolve().parent
QK_NORM_PASS = PACKAGE / "compilation/passes/fusion/qk_norm_rope_kvcache_fusion.py"
FLAGS = ("fuse_qk_norm_rope_kvcache", "fuse_rope_kvcache")


class _RocmPlatform(Platform):
    _enum = PlatformEnum.ROCM
    device_type = "cuda"


class _XpuPlatform(Platform):
    _enum = PlatformEnum.XPU
    device_type = "xpu"


def _use_platform(monkeypatch: pytest.MonkeyPatch, platform: Platform) -> None:
    """Make ``platform`` vLLM's current platform, also for the config modules,
    which bound ``current_platform`` when they were imported."""
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
    for module in (vllm.config.compilation, vllm.config.vllm):
        monkeypatch.setattr(module, "current_platform", platform)


@pytest.fixture
def hopper(
    monkeypatch: pytest.MonkeyPatch, hopper_platform_cls: type[NonNvmlCudaPlatform]
) -> Iterator[None]:
    _use_platform(monkeypatch, hopper_platform_cls())
    yield


def _both_on() -> dict[str, bool]:
    return dict.fromkeys(FLAGS, True)


# ---------------------------------------------------------------------------
# PassConfig
# ---------------------------------------------------------------------------


@pytest.mark.usefixtures("hopper")
def test_flags_stay_on_on_cuda():
    config = PassConfig(**_both_on())
    assert config.fuse_qk_norm_rope_kvcache is True
    assert config.fuse_rope_kvcache is True


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("flag", FLAGS)
def test_one_flag_leaves_the_other_alone(flag: str):
    config = PassConfig(**{flag: True})
    for name in FLAGS:
        assert getattr(config, name) is (True if name == flag else None)


@pytest.mark.usefixtures("hopper")
def test_flags_stay_off_when_not_asked_for():
    config = PassConfig(fuse_qk_norm_rope_kvcache=False, fuse_rope_kvcache=False)
    assert config.fuse_qk_norm_rope_kvcache is False
    assert config.fuse_rope_kvcache is False


def test_flags_stay_on_on_rocm(monkeypatch: pytest.MonkeyPatch):
    _use_platform(monkeypatch, _RocmPlatform())
    config = PassConfig(**_both_on())
    assert config.fuse_qk_norm_rope_kvcache is True
    assert config.fuse_rope_kvcache is True


@pytest.mark.parametrize("platform", [CpuPlatform, _XpuPlatform])
def test_flags_forced_off_elsewhere(
    monkeypatch: pytest.MonkeyPatch, platform: type[Platform]
):
    _use_platform(monkeypatch, platform())
    config = PassConfig(**_both_on())
    assert config.fuse_qk_norm_rope_kvcache is False
    assert config.fuse_rope_kvcache is False


@pytest.mark.usefixtures("hopper")
def test_the_other_rocm_only_fusions_stay_forced_off():
    config = PassConfig(fuse_act_padding=True, fuse_mla_dual_rms_norm=True)
    assert config.fuse_act_padding is False
    assert config.fuse_mla_dual_rms_norm is False


# ---------------------------------------------------------------------------
# VllmConfig: the settings that serve a model with the fused prologue
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    path = tmp_path_factory.mktemp("fusion_model")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "num_hidden_layers": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return ModelConfig(
        model=str(path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096
    )


def _vllm_config(model_config: ModelConfig, **compilation) -> VllmConfig:
    return VllmConfig(
        model_config=model_config,
        compilation_config=CompilationConfig(**compilation),
        attention_config=AttentionConfig(backend=AttentionBackendEnum.HPC_ATTN),
        cache_config=CacheConfig(block_size=64),
    )


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize(
    "split",
    [{"splitting_ops": []}, {"use_inductor_graph_partition": True}],
    ids=["no-splitting-ops", "graph-partition"],
)
def test_vllm_config_keeps_the_flags(model_config: ModelConfig, split: dict):
    config = _vllm_config(model_config, pass_config=_both_on(), **split)
    compilation = config.compilation_config
    assert compilation.pass_config.fuse_qk_norm_rope_kvcache is True
    assert compilation.pass_config.fuse_rope_kvcache is True
    # The passes match vLLM's rotary-embedding op, not its native form.
    assert "+rotary_embedding" in compilation.custom_ops
    if split.get("splitting_ops") == []:
        assert compilation.cudagraph_mode == CUDAGraphMode.FULL
    else:
        # The K/V cache write stays in the graph the passes see.
        assert compilation.splitting_ops is not None
        assert "vllm::unified_kv_cache_update" not in compilation.splitting_ops


@pytest.mark.usefixtures("hopper")
def test_vllm_config_needs_the_kv_write_in_the_graph(model_config: ModelConfig):
    # By default the K/V cache write is a splitting op, out of the passes'
    # reach, and vLLM turns both flags off.
    config = _vllm_config(model_config, pass_config=_both_on())
    assert config.compilation_config.pass_config.fuse_qk_norm_rope_kvcache is False
    assert config.compilation_config.pass_config.fuse_rope_kvcache is False


@pytest.mark.usefixtures("hopper")
def test_vllm_config_does_not_turn_them_on_by_itself(model_config: ModelConfig):
    # At vLLM's default optimisation level they are on only with AITER.
    config = _vllm_config(model_config, use_inductor_graph_partition=True)
    assert not config.compilation_config.pass_config.fuse_qk_norm_rope_kvcache
    assert not config.compilation_config.pass_config.fuse_rope_kvcache


# ---------------------------------------------------------------------------
# The passes
# ---------------------------------------------------------------------------


def test_fp8_query_form_is_registered_on_rocm_only():
    """Its per-tensor Q quantisation is an AITER op that only ROCm
    registers; tracing it on CUDA would fail on the first layer whose
    implementation supports the fusion."""
    text = QK_NORM_PASS.read_text()
    assert (
        "quant_forms = [False, True] if current_platform.is_rocm() else [False]" in text
    )
    assert "for quant_q in quant_forms:" in text
    if torch.version.hip is None:
        assert not hasattr(torch.ops.vllm, "rocm_aiter_per_tensor_quant")


def _cuda_ops_loaded() -> bool:
    try:
        return hasattr(torch.ops._C, "rotary_embedding")
    except (AttributeError, RuntimeError):
        return False


@pytest.mark.skipif(
    not _cuda_ops_loaded(), reason="the fusion passes need vLLM's CUDA ops (vllm._C)"
)
@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize("supported", [True, False])
def test_passes_fuse_only_layers_that_support_them(
    model_config: ModelConfig,
    monkeypatch: pytest.MonkeyPatch,
    hopper_platform_cls: type[NonNvmlCudaPlatform],
    supported: bool,
):
    from vllm.compilation.passes.fusion import (
        qk_norm_rope_kvcache_fusion as qk_norm_pass,
    )
    from vllm.compilation.passes.fusion.rope_kvcache_fusion import (
        RopeKVCacheFusionPass,
    )
    from vllm.model_executor.layers.attention import Attention
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends import hpc_attn

    monkeypatch.setattr(qk_norm_pass, "current_platform", hopper_platform_cls())
    Impl = hpc_attn.HpcAttentionImpl
    for hook in (
        "fused_qk_norm_rope_kvcache_supported",
        "fused_rope_kvcache_supported",
    ):
        monkeypatch.setattr(Impl, hook, lambda self: supported)
    config = _vllm_config(
        model_config, pass_config=_both_on(), use_inductor_graph_partition=True
    )
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        for i in range(2):
            Attention(
                8,
                128,
                128**-0.5,
                num_kv_heads=2,
                cache_config=config.cache_config,
                prefix=f"model.layers.{i}.self_attn.attn",
            )
        matchers = {
            "QkNormRopeKvCacheFusionPass": qk_norm_pass.QkNormRopeKvCacheFusionPass(
                config
            ).patterns,
            "RopeKVCacheFusionPass": RopeKVCacheFusionPass(config).patterns,
        }
    for name, matcher in matchers.items():
        registered = sum(len(entries) for entries in matcher.patterns.values())
        assert (registered > 0) is supported, name
