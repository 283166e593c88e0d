# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of the HPC_ATTN backend inside the real vLLM 0.33.0.

vLLM's own selector, Attention layer, KV-cache view code and batch split run
unchanged on a CPU machine that poses as a Hopper GPU. The kernels are never
launched: the workspaces, the attention ops and vLLM's cache-write op are
replaced by recording stand-ins that check what each is handed.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import regex as re
import torch

# Imported before the platform is switched, so that the attention layer's
# module does not try to load the CUDA-only flash-attention package.
import vllm.model_executor.layers.attention  # noqa: F401
import vllm.platforms
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.forward_context import (
    ForwardContext,
    override_forward_context,
)
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.hpc import rope_norm
from vllm.platforms.interface import DeviceCapability
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends import hpc_attn
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
)
from vllm.v1.attention.selector import (
    _cached_get_attn_backend,
    get_attn_backend,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    KVQuantMode,
    SlidingWindowSpec,
    create_kv_cache_views,
)
from vllm.v1.worker.utils import (
    customize_attention_spec,
    select_common_block_size,
)

if TYPE_CHECKING:
    from vllm.platforms.cuda import NonNvmlCudaPlatform

Backend = hpc_attn.HpcAttentionBackend
Builder = hpc_attn.HpcAttnMetadataBuilder
Impl = hpc_attn.HpcAttentionImpl
Metadata = hpc_attn.HpcAttnMetadata
FP8 = torch.float8_e4m3fn
HPC = AttentionBackendEnum.HPC_ATTN


# ---------------------------------------------------------------------------
# Harness: a CPU that vLLM takes for an sm90 GPU
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def hopper_platform(
    hopper_platform_cls: type[NonNvmlCudaPlatform],
) -> Iterator[type[NonNvmlCudaPlatform]]:
    saved = vllm.platforms._current_platform
    vllm.platforms._current_platform = hopper_platform_cls()
    try:
        yield hopper_platform_cls
    finally:
        vllm.platforms._current_platform = saved
        _cached_get_attn_backend.cache_clear()


@pytest.fixture(autouse=True)
def fresh_selection() -> Iterator[None]:
    _cached_get_attn_backend.cache_clear()
    yield
    _cached_get_attn_backend.cache_clear()


_MODEL_DIRS: dict[tuple, Path] = {}


def _model_config(
    tmp_root: Path,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: str = "bfloat16",
    max_model_len: int = 4096,
) -> ModelConfig:
    """A ModelConfig of a Llama-architecture checkpoint with these heads."""
    key = (num_heads, num_kv_heads, head_dim)
    path = _MODEL_DIRS.get(key)
    if path is None or not path.exists():
        path = tmp_root / f"model_{num_heads}_{num_kv_heads}_{head_dim}"
        path.mkdir(parents=True, exist_ok=True)
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": num_heads * head_dim,
            "intermediate_size": 2048,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "num_hidden_layers": 2,
            "vocab_size": 1024,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "torch_dtype": dtype,
        }
        (path / "config.json").write_text(json.dumps(config))
        _MODEL_DIRS[key] = path
    return ModelConfig(
        model=str(path),
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=max_model_len,
    )


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hpc_attn_models")


def _vllm_config(
    model_config: ModelConfig | None = None,
    *,
    kv_cache_dtype: str = "auto",
    block_size: int | None = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 2048,
    num_speculative_tokens: int = 0,
    parallel_drafting: bool = False,
) -> VllmConfig:
    cache_kwargs = {"cache_dtype": kv_cache_dtype}
    if block_size is not None:
        cache_kwargs["block_size"] = block_size
    extra = {} if model_config is None else {"model_config": model_config}
    config = VllmConfig(
        **extra,
        attention_config=AttentionConfig(backend=HPC),
        cache_config=CacheConfig(**cache_kwargs),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=model_config.max_model_len if model_config else 8192,
            is_encoder_decoder=False,
        ),
    )
    if num_speculative_tokens:
        # The builder reads only these fields; a real SpeculativeConfig needs
        # a draft model.
        object.__setattr__(
            config,
            "speculative_config",
            types.SimpleNamespace(
                num_speculative_tokens=num_speculative_tokens,
                parallel_drafting=parallel_drafting,
                enable_adaptive_verification=False,
            ),
        )
    return config


_layer_ids = iter(range(10**6))


def _attention(
    config: VllmConfig, num_heads: int, num_kv_heads: int, head_dim: int, **kw
):
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        return Attention(
            num_heads,
            head_dim,
            head_dim**-0.5,
            num_kv_heads=num_kv_heads,
            cache_config=config.cache_config,
            prefix=f"model.layers.{next(_layer_ids)}.self_attn.attn",
            **kw,
        )


def _select(config: VllmConfig, head_size: int = 128, **kw) -> type:
    kw.setdefault("dtype", torch.bfloat16)
    kw.setdefault("kv_cache_dtype", config.cache_config.cache_dtype)
    with set_current_vllm_config(config):
        return get_attn_backend(head_size, **kw)


# ---------------------------------------------------------------------------
# Registry and imports
# ---------------------------------------------------------------------------


def test_registry_resolves_to_this_backend():
    assert HPC.get_class() is Backend
    assert AttentionBackendEnum[Backend.get_name()] is HPC
    assert Backend.get_impl_cls() is Impl
    assert Backend.get_builder_cls() is Builder


def test_splitting_op_of_the_prologue_is_listed():
    from vllm.config.compilation import CompilationConfig

    assert "vllm::hpc_rope_norm_forward" in CompilationConfig._attention_ops


def test_imports_without_gpu_library_or_hpc_package():
    # A fresh interpreter in which the external package is missing and the
    # kernel library cannot load: the module imports and the backend then
    # declines at selection with a reason.
    code = (
        "import sys, types\n"
        "sys.modules['hpc'] = None\n"
        "sys.modules.setdefault('vllm._C_stable_libtorch', "
        "types.ModuleType('vllm._C_stable_libtorch'))\n"
        "import torch\n"
        "_load = torch.ops.load_library\n"
        "def _refuse(path):\n"
        "    if '_hpc_C' in str(path):\n"
        "        raise OSError('no library')\n"
        "    return _load(path)\n"
        "torch.ops.load_library = _refuse\n"
        "import vllm._hpc_ops as ops\n"
        "assert not ops.hpc_ops_available()\n"
        "from vllm.v1.attention.backends import hpc_attn\n"
        "from vllm.platforms.interface import DeviceCapability\n"
        "print(hpc_attn.HpcAttentionBackend.supports_combination("
        "128, torch.bfloat16, 'auto', 64, False, False, False, False, "
        "DeviceCapability(9, 0)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "_hpc_C" in result.stdout.strip().splitlines()[-1]


def test_module_does_not_import_external_package():
    source = Path(hpc_attn.__file__).read_text()
    assert "import hpc\n" not in source and "from hpc " not in source


# ---------------------------------------------------------------------------
# Selection and layer construction through vLLM's own code
# ---------------------------------------------------------------------------

_SHAPES = [
    # name, num_heads, num_kv_heads, head_dim, kv_cache_dtype, layer kwargs
    ("llama3-8b", 32, 8, 128, "auto", {}),
    ("qwen3-8b-bf16", 32, 8, 128, "bfloat16", {}),
    ("qwen3-8b-fp8", 32, 8, 128, "fp8", {}),
    ("qwen3-8b-fp8_e4m3", 32, 8, 128, "fp8_e4m3", {}),
    ("hy3-tp1", 64, 8, 128, "fp8_e4m3", {}),
    ("hy3-tp8", 8, 1, 128, "auto", {}),
    ("gqa5", 40, 8, 128, "auto", {}),
    ("head256", 16, 4, 256, "auto", {}),
    ("head64-gqa16", 32, 2, 64, "fp8", {}),
    ("sliding-window", 32, 8, 128, "auto", {"per_layer_sliding_window": 4096}),
    ("soft-cap", 16, 8, 256, "auto", {"logits_soft_cap": 50.0}),
]


@pytest.mark.parametrize(
    "name,num_heads,num_kv_heads,head_dim,kv_cache_dtype,layer_kwargs",
    _SHAPES,
    ids=[s[0] for s in _SHAPES],
)
def test_selector_picks_backend_and_layer_constructs(
    model_root, name, num_heads, num_kv_heads, head_dim, kv_cache_dtype, layer_kwargs
):
    config = _vllm_config(
        _model_config(model_root, num_heads, num_kv_heads, head_dim),
        kv_cache_dtype=kv_cache_dtype,
    )
    assert _select(config, head_dim) is Backend
    layer = _attention(config, num_heads, num_kv_heads, head_dim, **layer_kwargs)
    assert layer.attn_backend is Backend
    assert isinstance(layer.impl, Impl)
    impl = layer.impl
    assert impl.num_heads == num_heads and impl.num_kv_heads == num_kv_heads
    assert impl.scale == pytest.approx(head_dim**-0.5)
    # The kernels take bf16 queries over an FP8 cache: the layer must not
    # quantise them.
    assert impl.supports_quant_query_input is False
    assert layer.query_quant is None
    window = layer_kwargs.get("per_layer_sliding_window")
    assert impl.window == (window or 0)
    assert impl.logits_soft_cap == layer_kwargs.get("logits_soft_cap", 0.0)

    spec = layer.get_kv_cache_spec(config)
    assert spec.block_size == 64 if window is None else spec.block_size > 0
    fp8 = kv_cache_dtype.startswith("fp8")
    assert impl.use_fp8 is fp8
    if fp8:
        assert spec.dtype == torch.uint8
        assert spec.kv_quant_mode == KVQuantMode.FP8_PER_TENSOR
    else:
        assert spec.dtype == torch.bfloat16
    if window is not None:
        assert isinstance(spec, SlidingWindowSpec)
        assert spec.sliding_window == window


def test_preferred_block_size():
    assert Backend.get_preferred_block_size(16) == 64
    assert Backend.get_preferred_block_size(64) == 64
    assert Backend.get_preferred_block_size(128) == 128
    assert Backend.get_supported_kernel_block_sizes() == [16, 32, 64]


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_user_block_sizes_accepted(block_size):
    assert _select(_vllm_config(block_size=block_size)) is Backend


def _reasons(config: VllmConfig, head_size: int = 128, **kw) -> str:
    with pytest.raises(ValueError, match="HPC_ATTN is not valid") as info:
        _select(config, head_size, **kw)
    return str(info.value)


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (dict(head_size=96), "head_size not supported"),
        (dict(head_size=512), "head_size not supported"),
        (dict(dtype=torch.float32), "dtype not supported"),
        (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype not supported"),
        (dict(kv_cache_dtype="fp8_inc"), "kv_cache_dtype not supported"),
        (dict(has_sink=True), "attention sinks not supported"),
        (dict(use_mla=True), "MLA not supported"),
        (dict(attn_type="encoder_only"), "attention type encoder_only not supported"),
        (dict(attn_type="encoder"), "attention type encoder not supported"),
        (
            dict(dtype=torch.float16, kv_cache_dtype="bfloat16"),
            "differs from the model dtype",
        ),
    ],
)
def test_rejections_with_reasons(kwargs, reason):
    assert reason in _reasons(_vllm_config(), **kwargs)


def test_rejects_small_user_block_size():
    assert "block_size not supported" in _reasons(_vllm_config(block_size=8))


@pytest.mark.parametrize("capability", [(8, 0), (10, 0), (12, 0)])
def test_rejects_other_compute_capabilities(hopper_platform, capability):
    hopper_platform.capability = DeviceCapability(*capability)
    try:
        assert "compute capability not supported" in _reasons(_vllm_config())
    finally:
        hopper_platform.capability = DeviceCapability(9, 0)


def test_accepts_other_hopper_capability(hopper_platform):
    hopper_platform.capability = DeviceCapability(9, 0)
    assert Backend.supports_compute_capability(DeviceCapability(9, 0))
    assert not Backend.supports_compute_capability(DeviceCapability(8, 9))


def test_rejects_missing_library(monkeypatch):
    monkeypatch.setattr(hpc_attn, "has_hpc_kernels", lambda: False)
    assert "vllm._hpc_C kernel library is not built" in _reasons(_vllm_config())


def test_rejects_gqa_above_16_at_selection(model_root):
    config = _vllm_config(_model_config(model_root, 64, 2, 128))
    assert "GQA ratio 32" in _reasons(config)


def test_auto_selection_never_picks_it():
    config = VllmConfig(
        attention_config=AttentionConfig(backend=None),
        cache_config=CacheConfig(block_size=64),
    )
    with set_current_vllm_config(config):
        try:
            chosen = get_attn_backend(128, torch.bfloat16, "auto")
        except ValueError:
            return
    assert chosen is not Backend


def test_adaptive_verification_declined():
    assert Backend.supports_device_cpu_query_lens_mismatch() is False


@pytest.mark.parametrize(
    "kwargs,exc,needle",
    [
        (dict(alibi_slopes=[0.5] * 8), NotImplementedError, "ALiBi"),
        (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    ],
)
def test_layer_construction_rejects(kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        _attention(_vllm_config(), 8, 8, 128, **kwargs)


@pytest.mark.parametrize(
    "args,kwargs,needle",
    [
        ((34, 128, 0.1, 2), {}, "GQA ratio 17"),
        ((12, 128, 0.1, 8), {}, "multiple"),
        ((8, 80, 0.1, 8), {}, "head sizes"),
        ((8, 128, 0.1, 8), dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype"),
        ((8, 128, 0.0, 8), {}, "scale"),
        ((8, 128, 0.1, 8), dict(sliding_window=0), "sliding_window"),
        ((8, 128, 0.1, 8), dict(sinks=torch.zeros(8)), "sinks"),
        ((8, 128, 0.1, 8), dict(attn_type="encoder"), "decoder"),
    ],
)
def test_impl_rejects_unsupported_configs(args, kwargs, needle):
    with pytest.raises((ValueError, NotImplementedError), match=needle):
        Impl(*args, **kwargs)


# ---------------------------------------------------------------------------
# KV-cache views
# ---------------------------------------------------------------------------


def _views(spec, num_blocks, layout, kernel_block_size=None, num_layers=2):
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * num_blocks * num_layers,
        layers=[f"l{i}" for i in range(num_layers)],
        layer_stride=page * num_blocks,
        block_stride=page,
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(
        raw, spec, num_blocks, layout, tensor, kernel_block_size=kernel_block_size
    )
    return raw, views


@pytest.mark.parametrize(
    "dtype,num_kv_heads,strides,page",
    [
        (torch.bfloat16, 8, (131072, 256, 2048, 1), 262144),
        (torch.bfloat16, 1, (16384, 256, 256, 1), 32768),
        (torch.uint8, 8, (131072, 256, 2048, 1), 131072),
        (torch.uint8, 1, (16384, 256, 256, 1), 16384),
    ],
)
def test_kv_cache_views_lbnhc(dtype, num_kv_heads, strides, page):
    quant = KVQuantMode.FP8_PER_TENSOR if dtype == torch.uint8 else KVQuantMode.NONE
    spec = FullAttentionSpec(
        block_size=64,
        num_kv_heads=num_kv_heads,
        head_size=128,
        dtype=dtype,
        kv_quant_mode=quant,
    )
    assert spec.page_size_bytes == page
    _, views = _views(spec, 3, KVCacheLayout.LBNHC)
    view = views[1]
    assert view.shape == (3, num_kv_heads, 64, 256) and view.dtype == dtype
    assert view.stride() == strides

    fp8 = dtype == torch.uint8
    kv = hpc_attn.layer_kv_cache(view, _scaled_layer(), 128, fp8)
    key, value = kv.key, kv.value
    assert key.shape == value.shape == (3, 64, num_kv_heads, 128)
    assert value.data_ptr() - key.data_ptr() == 128 * view.element_size()
    # The kernels' stride rule: unit stride over D, the others 16-byte
    # multiples.
    for t in (key, value):
        assert t.stride(3) == 1
        assert all(s * t.element_size() % 16 == 0 for s in t.stride()[:3])
    assert key.dtype == value.dtype == (FP8 if fp8 else dtype)
    assert (kv.k_scale is not None) == fp8 and (kv.v_scale is not None) == fp8


def _scaled_layer(k_scale: float = 0.5, v_scale: float = 0.25) -> Any:
    """The attributes layer_kv_cache reads of an attention layer."""
    return types.SimpleNamespace(
        _k_scale=torch.tensor(k_scale), _v_scale=torch.tensor(v_scale)
    )


def test_layer_kv_cache_addresses_upstream_layout():
    nb, hkv, bs, d = 3, 2, 16, 64
    kv_cache = torch.zeros(nb, hkv, bs, 2 * d, dtype=torch.bfloat16)
    kv = hpc_attn.layer_kv_cache(kv_cache, _scaled_layer(), d, False)
    key, value = kv.key, kv.value
    assert key.shape == value.shape == (nb, bs, hkv, d)
    assert key.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert kv.k_scale is None and kv.v_scale is None

    k = torch.randn(hkv, d).to(torch.bfloat16)
    v = torch.randn(hkv, d).to(torch.bfloat16)
    key[2, 5] = k
    value[2, 5] = v
    for h in range(hkv):
        assert torch.equal(kv_cache[2, h, 5, :d], k[h])
        assert torch.equal(kv_cache[2, h, 5, d:], v[h])
    assert int((kv_cache != 0).sum()) == int((k != 0).sum() + (v != 0).sum())


@pytest.mark.parametrize("storage", [torch.uint8, FP8])
def test_layer_kv_cache_fp8_shares_the_layer_scales(storage):
    kv_cache = torch.zeros(2, 1, 16, 256, dtype=storage)
    layer = _scaled_layer()
    kv = hpc_attn.layer_kv_cache(kv_cache, layer, 128, True)
    assert kv.key.dtype == kv.value.dtype == FP8
    kv.key[1, 3, 0, 0] = 1.0
    byte = torch.tensor(1.0).to(FP8).view(torch.uint8)
    assert kv_cache.view(torch.uint8)[1, 0, 3, 0].item() == byte
    assert kv.k_scale is not None and kv.v_scale is not None
    assert kv.k_scale.shape == kv.v_scale.shape == (1,)
    assert kv.k_scale.data_ptr() == layer._k_scale.data_ptr()
    assert kv.v_scale.data_ptr() == layer._v_scale.data_ptr()


def test_layer_kv_cache_rejects_bad_input():
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_blocks"):
        hpc_attn.layer_kv_cache(torch.zeros(2, 1, 16, 128), _scaled_layer(), 128, False)
    with pytest.raises(ValueError, match="uint8 or float8_e4m3fn"):
        hpc_attn.layer_kv_cache(
            torch.zeros(2, 1, 16, 256, dtype=torch.bfloat16), _scaled_layer(), 128, True
        )


def test_kv_cache_views_lbhnc_meet_kernel_strides():
    spec = FullAttentionSpec(
        block_size=32, num_kv_heads=4, head_size=64, dtype=torch.bfloat16
    )
    _, views = _views(spec, 5, KVCacheLayout.LBHNC)
    key, value = views[0].transpose(1, 2).split(64, dim=-1)
    assert key.shape == (5, 32, 4, 64)
    assert key.stride() == (4 * 32 * 128, 128, 32 * 128, 1)
    assert all(s * 2 % 16 == 0 for s in key.stride()[:3])
    assert value.data_ptr() - key.data_ptr() == 64 * 2


def test_layouts_declared():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    assert Backend.supported_kv_cache_layouts() == (
        KVCacheLayout.LBNHC,
        KVCacheLayout.LBHNC,
    )
    assert get_supported_kv_cache_layouts([Backend, TritonAttentionBackend]) == [
        KVCacheLayout.LBNHC,
        KVCacheLayout.LBHNC,
    ]


def test_manager_block_of_128_splits_into_64_token_kernel_blocks():
    spec = FullAttentionSpec(
        block_size=128, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    assert select_common_block_size(128, [Backend], [spec]) == 64
    assert customize_attention_spec(Backend, spec).block_stride_alignment == (
        MultipleOf(64)
    )
    num_blocks = 3
    raw, manager = _views(spec, num_blocks, KVCacheLayout.LBNHC)
    kernel = create_kv_cache_views(
        raw,
        spec,
        num_blocks,
        KVCacheLayout.LBNHC,
        KVCacheTensor(
            size=raw.numel(),
            layers=["l0", "l1"],
            layer_stride=spec.page_size_bytes * num_blocks,
            block_stride=spec.page_size_bytes,
        ),
        kernel_block_size=64,
    )
    assert manager[0].shape == (3, 8, 128, 256)
    assert kernel[0].shape == (6, 8, 64, 256)
    assert kernel[0].stride() == (64 * 8 * 256, 256, 8 * 256, 1)
    # Slot b * 128 + o of a manager block is slot (2b + o // 64) * 64 + o % 64
    # of the kernel blocks: the same bytes.
    for b, o in [(0, 0), (1, 63), (1, 64), (2, 127)]:
        assert (
            manager[1][b, 3, o].data_ptr()
            == kernel[1][2 * b + o // 64, 3, o % 64].data_ptr()
        )
    assert manager[1].data_ptr() - raw.data_ptr() == spec.page_size_bytes * 3


# ---------------------------------------------------------------------------
# Builder
# ---------------------------------------------------------------------------


class _FakeDecodeWorkspace:
    """Records creation and planning (DecodeWorkspace needs a CUDA device)."""

    instances: list[_FakeDecodeWorkspace] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.max_query_tokens = kwargs["max_query_tokens"]
        self.plans: list[tuple[torch.Tensor, list[int], int]] = []

    @classmethod
    def create(cls, **kwargs) -> _FakeDecodeWorkspace:
        ws = cls(**kwargs)
        cls.instances.append(ws)
        return ws

    def plan(self, kv_lens: torch.Tensor, query_tokens: int = 1) -> None:
        self.plans.append((kv_lens, kv_lens.tolist(), query_tokens))


class _FakePrefillWorkspace:
    instances: list[_FakePrefillWorkspace] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.plans: list[tuple[torch.Tensor, list[int], torch.Tensor, list[int]]] = []

    @classmethod
    def create(cls, **kwargs) -> _FakePrefillWorkspace:
        ws = cls(**kwargs)
        cls.instances.append(ws)
        return ws

    def plan(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> None:
        self.plans.append(
            (query_start_loc, query_start_loc.tolist(), seq_lens, seq_lens.tolist())
        )


@pytest.fixture
def fake_workspaces(monkeypatch):
    monkeypatch.setattr(hpc_attn, "DecodeWorkspace", _FakeDecodeWorkspace)
    monkeypatch.setattr(hpc_attn, "PrefillWorkspace", _FakePrefillWorkspace)


@pytest.fixture(scope="module")
def llama_model(model_root) -> ModelConfig:
    return _model_config(model_root, 32, 8, 128)


def _spec(kv_cache_dtype: str = "auto", block_size: int = 64, window=None):
    fp8 = kv_cache_dtype.startswith("fp8")
    kwargs = dict(
        block_size=block_size,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.uint8 if fp8 else torch.bfloat16,
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE,
    )
    if window is not None:
        return SlidingWindowSpec(sliding_window=window, **kwargs)
    return FullAttentionSpec(**kwargs)


def _builder(model, *, kv_cache_dtype="auto", num_spec=0, window=None, **kw):
    config = _vllm_config(
        model, kv_cache_dtype=kv_cache_dtype, num_speculative_tokens=num_spec, **kw
    )
    with set_current_vllm_config(config):
        builder = Builder(
            _spec(kv_cache_dtype, window=window), [], config, torch.device("cpu")
        )
    return builder


class _Inputs:
    """Persistent input buffers, as a model runner keeps them."""

    def __init__(self, max_reqs: int = 16, max_tokens: int = 2048) -> None:
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32)
        self.block_table = torch.zeros(max_reqs, 32, dtype=torch.int32)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64)

    def common(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        num_tokens: int | None = None,
        max_seq_len: int | None = None,
    ) -> CommonAttentionMetadata:
        num_reqs = len(query_lens)
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
        real = int(qsl[-1])
        num_tokens = real if num_tokens is None else num_tokens
        self.query_start_loc[: num_reqs + 1] = qsl
        self.seq_lens[:num_reqs] = torch.tensor(seq_lens, dtype=torch.int32)
        self.block_table[:num_reqs] = (
            torch.arange(num_reqs * 32, dtype=torch.int32).view(num_reqs, 32) + 1
        )
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:real] = torch.arange(real) + 1000
        self.positions[:num_tokens] = torch.arange(num_tokens)
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            query_start_loc_cpu=self.query_start_loc[: num_reqs + 1].clone(),
            seq_lens=self.seq_lens[:num_reqs],
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len or max(seq_lens),
            block_table_tensor=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            positions=self.positions[:num_tokens],
        )


def _assert_reset(md) -> None:
    assert md.hpc_decode_q_scale is None
    assert md.hpc_prefill_q_scale is None


def test_builder_sizes_workspaces_once(fake_workspaces, llama_model):
    _FakeDecodeWorkspace.instances.clear()
    _FakePrefillWorkspace.instances.clear()
    builder = _builder(llama_model, max_num_seqs=24, max_num_batched_tokens=4096)
    assert len(_FakeDecodeWorkspace.instances) == 1
    assert len(_FakePrefillWorkspace.instances) == 1
    dkw = _FakeDecodeWorkspace.instances[0].kwargs
    assert dkw["max_batch"] == 24
    assert dkw["num_q_heads"] == 32 and dkw["num_kv_heads"] == 8
    assert dkw["head_size"] == 128
    assert dkw["max_query_tokens"] == 1
    assert dkw["kv_cache_dtype"] == torch.bfloat16
    assert dkw["window"] == 0
    assert dkw["max_kv_tokens"] == 24 * llama_model.max_model_len
    pkw = _FakePrefillWorkspace.instances[0].kwargs
    assert pkw["max_tokens"] == 4096 and pkw["max_batch"] == 24
    assert pkw["num_q_heads"] == 32 and pkw["num_kv_heads"] == 8
    assert builder.q_scale_buffer is None
    assert builder.prefill_query_start_loc.shape == (25,)


def test_builder_fp8_and_window(fake_workspaces, llama_model):
    builder = _builder(
        llama_model, kv_cache_dtype="fp8", window=512, max_num_batched_tokens=1024
    )
    dkw = builder.decode_workspace.kwargs
    assert dkw["kv_cache_dtype"] == FP8
    assert dkw["window"] == 512
    assert builder.q_scale_buffer is not None
    assert builder.q_scale_buffer.shape == (1024, 32)
    assert builder.q_scale_buffer.dtype == torch.float32


@pytest.mark.parametrize("num_spec,threshold", [(0, 1), (1, 2), (2, 3), (3, 4)])
def test_reorder_threshold_and_cudagraph_support(
    fake_workspaces, llama_model, num_spec, threshold
):
    builder = _builder(llama_model, num_spec=num_spec)
    assert builder.reorder_batch_threshold == threshold
    assert builder.decode_workspace.kwargs["max_query_tokens"] == threshold
    expected = (
        AttentionCGSupport.UNIFORM_BATCH
        if num_spec
        else AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    assert Builder.get_cudagraph_support(builder.vllm_config, _spec()) == expected


def test_too_many_speculative_tokens_rejected(fake_workspaces, llama_model):
    with pytest.raises(ValueError, match="at most 7 speculative tokens"):
        _builder(llama_model, num_spec=8)


def test_speculative_rows_past_the_decode_tile_rejected(fake_workspaces, model_root):
    """GQA 16 (128 query heads over the spec's 8 KV heads): 4 query tokens
    fill the 64 rows of a KV head's decode tile, 5 do not fit."""
    gqa16 = _model_config(model_root, 128, 8, 128)
    _builder(gqa16, num_spec=3)
    with pytest.raises(ValueError, match=r"GQA ratio 16 are 80 rows per KV head"):
        _builder(gqa16, num_spec=4)


@pytest.mark.parametrize(
    "heads,num_spec,parallel_drafting,reason",
    [
        ((32, 8), 8, False, "9 query tokens .* at most 7 speculative tokens"),
        ((128, 8), 4, False, "5 query tokens x GQA ratio 16 are 80 rows"),
        # Model runner V1's parallel drafter adds num_spec slots per request.
        ((32, 8), 4, True, "9 query tokens .* at most 7 speculative tokens"),
    ],
)
def test_speculative_limits_refused_at_selection(
    model_root, monkeypatch, heads, num_spec, parallel_drafting, reason
):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    num_heads, num_kv_heads = heads
    model = _model_config(model_root, num_heads, num_kv_heads, 128)
    config = _vllm_config(
        model, num_speculative_tokens=num_spec, parallel_drafting=parallel_drafting
    )
    assert re.search(reason, _reasons(config))
    # One token fewer fits, and the builder agrees with the selector.
    fits = _vllm_config(model, num_speculative_tokens=num_spec - 1)
    assert _select(fits) is Backend


def _check_prefill_plan(builder, md, common, num_decodes):
    ws = builder.prefill_workspace
    assert len(ws.plans) == 1
    qsl, qsl_values, seq_lens, seq_values = ws.plans[0]
    assert qsl is md.qo_indptr
    assert qsl.data_ptr() == builder.prefill_query_start_loc.data_ptr()
    expected = (
        common.query_start_loc_cpu[num_decodes:] - md.num_decode_tokens
    ).tolist()
    assert qsl_values == expected and expected[0] == 0
    assert seq_values == common.seq_lens[num_decodes:].tolist()
    assert seq_lens.data_ptr() == common.seq_lens[num_decodes:].data_ptr()


@pytest.mark.parametrize(
    "query_lens,seq_lens,num_spec,split,dql",
    [
        # mixed: two decodes, an extend and a prefill
        ([1, 1, 5, 3], [9, 17, 40, 3], 0, (2, 2, 2, 8), 1),
        # decode only
        ([1, 1, 1], [5, 6, 7], 0, (3, 0, 3, 0), 1),
        # prefill only
        ([7, 3], [7, 20], 0, (0, 2, 0, 10), 1),
        # uniform speculative batch, 3 speculative tokens
        ([4, 4, 4], [10, 20, 30], 3, (3, 0, 12, 0), 4),
        # speculative: the one-token row is a prefill row
        ([3, 3, 1, 7], [30, 40, 50, 7], 2, (2, 2, 6, 8), 3),
        # speculative decode rows after a prefill-free drafting step
        ([1, 1], [5, 9], 2, (2, 0, 2, 0), 1),
    ],
    ids=["mixed", "decode-only", "prefill-only", "spec-uniform", "spec-1tok", "spec-1"],
)
def test_build_splits_and_plans_once(
    fake_workspaces, llama_model, query_lens, seq_lens, num_spec, split, dql
):
    builder = _builder(llama_model, num_spec=num_spec)
    inputs = _Inputs()
    common = inputs.common(query_lens, seq_lens)
    md = builder.build(0, common)

    nd, npf, ndt, npt = split
    assert (md.num_decodes, md.num_prefills) == (nd, npf)
    assert (md.num_decode_tokens, md.num_prefill_tokens) == (ndt, npt)
    assert md.decode_query_len == dql
    assert md.num_actual_tokens == common.num_actual_tokens
    assert md.seq_lens is common.seq_lens
    assert md.block_table_tensor is common.block_table_tensor
    assert md.slot_mapping is common.slot_mapping
    assert md.positions is common.positions
    assert md.decode_workspace is builder.decode_workspace
    assert md.prefill_workspace is builder.prefill_workspace
    _assert_reset(md)

    dws = builder.decode_workspace
    if nd:
        assert len(dws.plans) == 1
        kv_lens, values, query_tokens = dws.plans[0]
        assert kv_lens is md.decode_seq_lens
        assert kv_lens.data_ptr() == common.seq_lens.data_ptr()
        assert values == seq_lens[:nd] and query_tokens == dql
        assert md.decode_block_table.data_ptr() == common.block_table_tensor.data_ptr()
        assert md.decode_block_table.shape[0] == nd
        assert md.qo_indptr_decode.tolist() == common.query_start_loc[: nd + 1].tolist()
    else:
        assert dws.plans == []
        assert md.decode_seq_lens is None and md.qo_indptr_decode is None
    if npf:
        _check_prefill_plan(builder, md, common, nd)
        assert md.prefill_block_table.shape[0] == npf
        assert (
            md.prefill_block_table.data_ptr()
            == common.block_table_tensor[nd:].data_ptr()
        )
    else:
        assert builder.prefill_workspace.plans == []
        assert md.qo_indptr is None


@pytest.mark.parametrize(
    "query_lens,num_tokens,num_spec,dql",
    [([3, 3, 3, 0], 12, 2, 3), ([1, 1, 1, 0], 4, 0, 1), ([4, 4, 0, 0], 16, 3, 4)],
)
def test_build_padded_full_graph_batches(
    fake_workspaces, llama_model, query_lens, num_tokens, num_spec, dql
):
    builder = _builder(llama_model, num_spec=num_spec)
    inputs = _Inputs()
    seq_lens = [q + 10 if q else 0 for q in query_lens]
    common = inputs.common(query_lens, seq_lens, num_tokens=num_tokens)
    md = builder.build(0, common)
    # Padding requests (query length 0, seq_len 0) stay in the decode batch
    # so that its size matches the captured one; the kernel writes zeros for
    # them.
    assert md.num_decodes == len(query_lens)
    assert md.num_decode_tokens == num_tokens
    assert md.decode_query_len == dql
    assert md.num_prefills == 0
    ((kv_lens, values, query_tokens),) = builder.decode_workspace.plans
    assert values == seq_lens and query_tokens == dql


def test_build_excludes_trailing_padding_from_prefill_rows(
    fake_workspaces, llama_model
):
    builder = _builder(llama_model)
    common = _Inputs().common([1, 6], [9, 6], num_tokens=10)
    md = builder.build(0, common)
    assert md.num_prefill_tokens == 6
    assert md.qo_indptr.tolist() == [0, 6]


def test_build_rejects_prefill_beyond_plan(fake_workspaces, llama_model):
    builder = _builder(llama_model, max_num_batched_tokens=64)
    common = _Inputs(max_tokens=256).common([100], [100])
    with pytest.raises(ValueError, match="exceed"):
        builder.build(0, common)


def test_capture_metadata_reads_stable_addresses(fake_workspaces, llama_model):
    builder = _builder(llama_model, kv_cache_dtype="fp8", num_spec=1)
    inputs = _Inputs()
    max_len = llama_model.max_model_len
    seen = []
    for size in (2, 4, 8):
        # make_dummy style: seq_lens = query lengths, zero block table,
        # slots -1, max_seq_len = max_model_len.
        common = inputs.common([2] * size, [2] * size, max_seq_len=max_len)
        common.block_table_tensor.zero_()
        common.slot_mapping.fill_(-1)
        md = builder.build_for_cudagraph_capture(common)
        assert md.num_decodes == size and md.decode_query_len == 2
        seen.append(md)
    ptrs = {
        (
            md.seq_lens.data_ptr(),
            md.decode_seq_lens.data_ptr(),
            md.block_table_tensor.data_ptr(),
            md.decode_block_table.data_ptr(),
            md.slot_mapping.data_ptr(),
            md.hpc_q_scale_buffer.data_ptr(),
            id(md.decode_workspace),
        )
        for md in seen
    }
    assert len(ptrs) == 1
    # Mixed steps with different lengths keep the rebased offsets in place.
    a = builder.build(0, inputs.common([2, 9], [12, 9]))
    qsl_a = a.qo_indptr.data_ptr()
    b = builder.build(0, inputs.common([2, 2, 30, 4], [12, 14, 30, 50]))
    assert b.qo_indptr.data_ptr() == qsl_a
    assert b.qo_indptr.tolist() == [0, 30, 34]
    assert a is not b


# ---------------------------------------------------------------------------
# Forward with recording kernels
# ---------------------------------------------------------------------------


class _Recorder:
    def __init__(self, name: str, log: list) -> None:
        self.name = name
        self.log = log

    def __call__(self, *args, **kwargs) -> None:
        self.log.append((self.name, args, kwargs))


@pytest.fixture
def kernels(monkeypatch, fake_workspaces):
    log: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(hpc_attn, "decode_attention", _Recorder("decode", log))
    monkeypatch.setattr(hpc_attn, "prefill_attention", _Recorder("prefill", log))
    monkeypatch.setattr(hpc_attn, "reshape_and_cache_flash", _Recorder("write", log))
    monkeypatch.setattr(hpc_attn, "rope_norm_store_kv", _Recorder("prologue", log))
    return log


def _layer_stub(name: str = "model.layers.0.self_attn.attn"):
    return types.SimpleNamespace(
        layer_name=name,
        _k_scale=torch.tensor(0.5, dtype=torch.float32),
        _v_scale=torch.tensor(0.25, dtype=torch.float32),
        _q_scale=torch.tensor(1.0, dtype=torch.float32),
    )


def _kv_cache(fp8: bool, num_blocks: int = 8) -> torch.Tensor:
    dtype = torch.uint8 if fp8 else torch.bfloat16
    # LBNHC: the logical [B, H, N, 2D] view of token-major pages.
    return torch.zeros(num_blocks, 64, 8, 256, dtype=dtype).transpose(1, 2)


def _qkv_out(num_tokens: int, q_dtype=torch.bfloat16, out_dtype=torch.bfloat16):
    query = torch.randn(num_tokens, 32, 128).to(q_dtype)
    key = torch.randn(num_tokens, 8, 128).to(torch.bfloat16)
    value = torch.randn(num_tokens, 8, 128).to(torch.bfloat16)
    output = torch.full((num_tokens, 32, 128), 7.0, dtype=out_dtype)
    return query, key, value, output


def _calls(log, name):
    return [(a, k) for n, a, k in log if n == name]


def test_forward_profiling_run_zero_fills(kernels):
    impl = Impl(32, 128, 0.1, 8)
    q, k, v, out = _qkv_out(5)
    result = impl.forward(_layer_stub(), q, k, v, _kv_cache(False), None, out)
    assert result is out and not out.any()
    assert kernels == []


def test_forward_rejects_output_quant(kernels):
    impl = Impl(32, 128, 0.1, 8)
    q, k, v, out = _qkv_out(2)
    with pytest.raises(NotImplementedError, match="output quant"):
        impl.forward(_layer_stub(), q, k, v, _kv_cache(False), None, out, torch.ones(1))


def test_builder_derives_positions_when_the_runner_gives_none(
    fake_workspaces, llama_model
):
    builder = _builder(llama_model)
    # Two decodes, an extend of 5 after 35 cached, a prefill of 3, 2 padding
    # rows.
    common = _Inputs().common([1, 1, 5, 3], [9, 17, 40, 3], num_tokens=12)
    given = builder.build(0, common)
    assert given.positions is common.positions
    derived = builder.build(0, dataclasses.replace(common, positions=None))
    assert derived.positions is not None
    expected = [8, 16, 35, 36, 37, 38, 39, 0, 1, 2, 0, 0]
    assert derived.positions.tolist() == expected


def test_forward_bf16_mixed_batch(kernels, llama_model):
    builder = _builder(llama_model)
    # Two decodes, then an extend of 5 after 35 cached and a prefill of 3;
    # 2 padding rows.
    common = _Inputs().common([1, 1, 5, 3], [9, 17, 40, 3], num_tokens=12)
    md = builder.build(0, common)
    impl = Impl(32, 128, 0.0625, 8, None, None, "auto", 30.0)
    layer = _layer_stub()
    kv_cache = _kv_cache(False)
    q, k, v, out = _qkv_out(12)
    assert impl.forward(layer, q, k, v, kv_cache, md, out) is out

    # K/V were written before the call (do_kv_cache_update); forward only
    # launches.
    assert [n for n, _, _ in kernels] == ["decode", "prefill"]
    key_cache, value_cache = kv_cache.transpose(1, 2).split(128, dim=-1)

    ((dargs, dkw),) = _calls(kernels, "decode")
    dq, dk, dv, dbt, dlens, dout, dws = dargs
    assert dq.shape[0] == 2 and dq.data_ptr() == q.data_ptr()
    assert dout.shape[0] == 2 and dout.data_ptr() == out.data_ptr()
    assert dk.data_ptr() == key_cache.data_ptr() and dk.stride() == key_cache.stride()
    assert dv.data_ptr() == value_cache.data_ptr()
    assert dbt is md.decode_block_table and dlens is md.decode_seq_lens
    assert dws is builder.decode_workspace
    assert dkw == dict(
        scale=0.0625,
        query_tokens=1,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        softcap=30.0,
    )

    ((pargs, pkw),) = _calls(kernels, "prefill")
    pq, pk, pv, pbt, pqsl, plens, pout, pws = pargs
    assert pq.shape[0] == 8 and pq.data_ptr() == q[2].data_ptr()
    assert pout.shape[0] == 8 and pout.data_ptr() == out[2].data_ptr()
    assert pqsl is md.qo_indptr and pqsl.tolist() == [0, 5, 8]
    assert plens.tolist() == [40, 3] and pbt is md.prefill_block_table
    assert pws is builder.prefill_workspace
    assert pkw == dict(
        scale=0.0625,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        softcap=30.0,
        window=0,
    )


def test_forward_passes_window_to_prefill(kernels, llama_model):
    builder = _builder(llama_model, window=256)
    md = builder.build(0, _Inputs().common([4], [300]))
    impl = Impl(32, 128, 0.1, 8, None, 256)
    q, k, v, out = _qkv_out(4)
    impl.forward(_layer_stub(), q, k, v, _kv_cache(False), md, out)
    ((_, pkw),) = _calls(kernels, "prefill")
    assert pkw["window"] == 256
    assert builder.decode_workspace.kwargs["window"] == 256


def test_forward_speculative_decode(kernels, llama_model):
    builder = _builder(llama_model, num_spec=2)
    md = builder.build(0, _Inputs().common([3, 3, 1, 7], [30, 40, 50, 7]))
    impl = Impl(32, 128, 0.1, 8)
    q, k, v, out = _qkv_out(14)
    impl.forward(_layer_stub(), q, k, v, _kv_cache(False), md, out)
    ((dargs, dkw),) = _calls(kernels, "decode")
    assert dargs[0].shape[0] == 6 and dkw["query_tokens"] == 3
    ((pargs, _),) = _calls(kernels, "prefill")
    assert pargs[0].shape[0] == 8 and pargs[0].data_ptr() == q[6].data_ptr()
    assert pargs[4].tolist() == [0, 1, 8]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_forward_fp8_cache_with_bf16_queries(kernels, llama_model, kv_cache_dtype):
    builder = _builder(llama_model, kv_cache_dtype=kv_cache_dtype)
    md = builder.build(0, _Inputs().common([1, 4], [10, 4]))
    impl = Impl(32, 128, 0.1, 8, None, None, kv_cache_dtype)
    layer = _layer_stub()
    kv_cache = _kv_cache(True)
    q, k, v, out = _qkv_out(5)
    impl.do_kv_cache_update(layer, k, v, kv_cache, md.slot_mapping)
    impl.forward(layer, q, k, v, kv_cache, md, out)

    ((wargs, _),) = _calls(kernels, "write")
    # vLLM's cache op quantises into the uint8 views.
    assert wargs[2].dtype == torch.uint8 and wargs[5] == kv_cache_dtype
    assert wargs[6] is layer._k_scale and wargs[7] is layer._v_scale
    for name in ("decode", "prefill"):
        ((args, kw),) = _calls(kernels, name)
        assert args[1].dtype == FP8 and args[2].dtype == FP8
        assert args[1].data_ptr() == kv_cache.data_ptr()
        assert kw["q_scale"] is None
        for scale, source in (
            (kw["k_scale"], layer._k_scale),
            (kw["v_scale"], layer._v_scale),
        ):
            assert scale.shape == (1,)
            assert scale.data_ptr() == source.data_ptr()
        out_arg = args[5] if name == "decode" else args[6]
        assert out_arg.dtype == torch.bfloat16


def test_forward_never_writes_kv(kernels, llama_model):
    builder = _builder(llama_model)
    common = _Inputs().common([1], [4])
    impl = Impl(32, 128, 0.1, 8)
    q, k, v, out = _qkv_out(1)
    impl.forward(
        _layer_stub(), q, k, v, _kv_cache(False), builder.build(0, common), out
    )
    impl.forward(
        _layer_stub(), q, None, None, _kv_cache(False), builder.build(0, common), out
    )
    assert [n for n, _, _ in kernels] == ["decode", "decode"]
    assert Backend.forward_includes_kv_cache_update is False


def test_do_kv_cache_update_writes_through_vllm_cache_op(kernels):
    impl = Impl(32, 128, 0.1, 8)
    layer = _layer_stub()
    kv_cache = _kv_cache(False)
    _, k, v, _ = _qkv_out(6)
    slots = torch.tensor([5, 6, 70, -1, -1, -1])
    # No forward context: nothing was handed off, so the layer writes.
    impl.do_kv_cache_update(layer, k, v, kv_cache, slots)
    ((wargs, _),) = _calls(kernels, "write")
    key_in, value_in, key_cache, value_cache, slot_arg, kv_dtype, ks, vs = wargs
    assert key_in is k and value_in is v and slot_arg is slots
    assert key_cache.shape == (8, 64, 8, 128) and key_cache.dtype == torch.bfloat16
    assert key_cache.data_ptr() == kv_cache.data_ptr()
    assert value_cache.data_ptr() == kv_cache.data_ptr() + 128 * 2
    assert key_cache.stride() == (64 * 8 * 256, 8 * 256, 256, 1)
    assert kv_dtype == "auto"
    assert ks is layer._k_scale and vs is layer._v_scale


def test_backend_takes_the_kv_cache_write_bypass():
    # A model whose prologue wrote K/V calls attention with key=None,
    # value=None; vLLM then skips the write (unified_kv_cache_update).
    assert Backend.supports_kv_cache_update_bypass is True
    assert Backend.forward_includes_kv_cache_update is False


def test_forward_fp8_query_without_scales_raises(kernels, llama_model):
    builder = _builder(llama_model, kv_cache_dtype="fp8")
    md = builder.build(0, _Inputs().common([1], [4]))
    impl = Impl(32, 128, 0.1, 8, None, None, "fp8")
    q, k, v, out = _qkv_out(1, q_dtype=FP8)
    with pytest.raises(RuntimeError, match="scales"):
        impl.forward(_layer_stub(), q, k, v, _kv_cache(True), md, out)


def _prologue(name: str, kv_cache_dtype: str) -> rope_norm.HpcRopeNorm:
    return rope_norm.HpcRopeNorm(
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        cos_sin_cache=torch.randn(8192, 128),
        use_qk_norm=False,
        fallback_qnorm=None,
        fallback_knorm=None,
        kv_cache_dtype=kv_cache_dtype,
        layer_name=name,
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_prologue_hand_off_two_layers_two_steps(kernels, llama_model, kv_cache_dtype):
    fp8 = kv_cache_dtype != "auto"
    config = _vllm_config(llama_model, kv_cache_dtype=kv_cache_dtype)
    with set_current_vllm_config(config):
        builder = Builder(_spec(kv_cache_dtype), [], config, torch.device("cpu"))
        names = [f"handoff.{kv_cache_dtype}.{i}.attn" for i in range(2)]
        prologues = [_prologue(n, kv_cache_dtype) for n in names]
    impls = [Impl(32, 128, 0.1, 8, None, None, kv_cache_dtype) for _ in names]
    layers = [_layer_stub(n) for n in names]
    caches = [_kv_cache(fp8) for _ in names]
    inputs = _Inputs()
    steps = [([1, 1, 6], [9, 12, 6]), ([1, 1, 1, 2], [10, 13, 7, 20])]
    for query_lens, seq_lens in steps:
        common = inputs.common(query_lens, seq_lens)
        md = builder.build(0, common)
        _assert_reset(md)
        num_tokens = common.num_actual_tokens
        for i in range(2):
            kernels.clear()
            qkv = torch.randn(num_tokens, (32 + 16) * 128).to(torch.bfloat16)
            q = torch.empty(num_tokens, 32, 128, dtype=FP8 if fp8 else torch.bfloat16)
            prologues[i]._forward_impl(qkv, caches[i], md, layers[i], q)
            if fp8:
                # The scales live in the builder's persistent buffer.
                assert builder.q_scale_buffer is not None
                assert md.hpc_decode_q_scale is not None
                ((pargs, pkw),) = _calls(kernels, "prologue")
                assert pkw["q_scale"].data_ptr() == builder.q_scale_buffer.data_ptr()
                assert md.hpc_decode_q_scale.shape == (md.num_decode_tokens, 32)
            # As the attention layer calls it after the prologue: K/V are in
            # the cache (key=None, value=None; vLLM skips its write).
            out = _qkv_out(num_tokens)[3]
            impls[i].forward(layers[i], q, None, None, caches[i], md, out)
            names_called = [n for n, _, _ in kernels]
            assert "write" not in names_called
            assert names_called[-2:] == ["decode", "prefill"]
            ((_, dkw),) = _calls(kernels, "decode")
            ((_, pkw),) = _calls(kernels, "prefill")
            if fp8:
                assert builder.q_scale_buffer is not None
                assert dkw["q_scale"].data_ptr() == builder.q_scale_buffer.data_ptr()
                assert dkw["q_scale"].shape == (md.num_decode_tokens, 32)
                assert pkw["q_scale"].shape == (md.num_prefill_tokens, 32)
                assert (
                    pkw["q_scale"].data_ptr()
                    == builder.q_scale_buffer[md.num_decode_tokens].data_ptr()
                )
            else:
                assert dkw["q_scale"] is None and pkw["q_scale"] is None
            # Consumed: nothing reaches the next layer or step.
            assert md.hpc_decode_q_scale is None and md.hpc_prefill_q_scale is None


def test_unfused_layer_after_fused_one_writes_its_own_kv(kernels, llama_model):
    config = _vllm_config(llama_model)
    with set_current_vllm_config(config):
        builder = Builder(_spec(), [], config, torch.device("cpu"))
        prologue = _prologue("mixed.fused.attn", "auto")
    md = builder.build(0, _Inputs().common([1, 3], [5, 3]))
    fused, unfused = Impl(32, 128, 0.1, 8), Impl(32, 128, 0.1, 8)
    fused_layer, unfused_layer = _layer_stub("mixed.fused.attn"), _layer_stub("l1")
    qkv = torch.randn(4, 48 * 128).to(torch.bfloat16)
    q, k, v, out = _qkv_out(4)
    ctx = ForwardContext(
        no_compile_layers={},
        attn_metadata={"mixed.fused.attn": md, "l1": md},
        slot_mapping={},
    )
    with override_forward_context(ctx):
        prologue._forward_impl(qkv, _kv_cache(False), md, fused_layer, q)
        fused.do_kv_cache_update(fused_layer, k, v, _kv_cache(False), md.slot_mapping)
        fused.forward(fused_layer, q, k, v, _kv_cache(False), md, out)
        kernels.clear()
        unfused.do_kv_cache_update(
            unfused_layer, k, v, _kv_cache(False), md.slot_mapping
        )
        unfused.forward(unfused_layer, q, k, v, _kv_cache(False), md, out)
    assert [n for n, _, _ in kernels] == ["write", "decode", "prefill"]


def test_prologue_is_an_eager_break_under_breakable_cudagraphs(monkeypatch):
    from vllm.compilation import breakable_cudagraph as bcg

    recorded = []

    class _Capture:
        _capturing = True

        def add_eager(self, fn):
            recorded.append(fn)
            return None

    monkeypatch.setattr(bcg.BreakableCUDAGraphCapture, "current", lambda: _Capture())
    monkeypatch.setattr(bcg, "is_forward_context_available", lambda: False)
    # Capture keeps weak references, an op of vLLM's CUDA library.
    monkeypatch.setattr(bcg, "_weak_ref_capture_arg", lambda arg: arg)
    qkv = torch.zeros(2, 48 * 128, dtype=torch.bfloat16)
    out = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    # Under capture the op is recorded for replay instead of being run (run
    # now, it would fail: there is no forward context).
    rope_norm.hpc_rope_norm_forward(qkv, out, "no.such.layer")
    assert len(recorded) == 1


def test_attention_group_maps_manager_blocks_to_kernel_blocks(
    fake_workspaces, llama_model
):
    from vllm.v1.worker.utils import AttentionGroup

    config = _vllm_config(llama_model, block_size=128)
    spec = _spec(block_size=128)
    group = AttentionGroup(Backend, [], spec, 0)
    with set_current_vllm_config(config):
        group.create_metadata_builders(config, torch.device("cpu"), 64)
    builder = group.get_metadata_builder()
    assert isinstance(builder, Builder)
    assert builder.kv_cache_spec.block_size == 64
    assert group.kernel_block_size == 64

    inputs = _Inputs()
    common = inputs.common([1, 70], [300, 200])
    common.block_table_tensor[:, :3] = torch.tensor([[5, 9, 2], [7, 1, 3]])
    md = group.build_metadata(common)
    # Manager block b holds kernel blocks 2b and 2b + 1.
    assert md.block_table_tensor[:, :6].tolist() == [
        [10, 11, 18, 19, 4, 5],
        [14, 15, 2, 3, 6, 7],
    ]
    assert md.decode_block_table.data_ptr() == md.block_table_tensor.data_ptr()
    assert md.prefill_block_table[0, :2].tolist() == [14, 15]


def test_builder_takes_window_from_the_group_layers(fake_workspaces, llama_model):
    config = _vllm_config(llama_model)
    a = _attention(config, 32, 8, 128, per_layer_sliding_window=256)
    b = _attention(config, 32, 8, 128, per_layer_sliding_window=512)
    with set_current_vllm_config(config):
        builder = Builder(_spec(), [a.layer_name], config, torch.device("cpu"))
        assert builder.window == 256
        assert isinstance(builder.decode_workspace, _FakeDecodeWorkspace)
        assert builder.decode_workspace.kwargs["window"] == 256
        with pytest.raises(ValueError, match="different sliding windows"):
            Builder(_spec(), [a.layer_name, b.layer_name], config, torch.device("cpu"))


# ---------------------------------------------------------------------------
# Fusion-pass hooks
# ---------------------------------------------------------------------------


@pytest.fixture
def fused_kernel(monkeypatch):
    log: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(hpc_attn, "rope_norm_store_kv", _Recorder("fused", log))
    return log


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_qk_norm_rope_kvcache_hook(fused_kernel, kv_cache_dtype):
    fp8 = kv_cache_dtype == "fp8"
    impl = Impl(32, 128, 0.1, 8, None, None, kv_cache_dtype)
    assert impl.fused_qk_norm_rope_kvcache_supported() is True
    layer = _layer_stub()
    kv_cache = _kv_cache(fp8)
    qkv = torch.randn(5, 48 * 128).to(torch.bfloat16)
    q_out = torch.empty(5, 32, 128, dtype=torch.bfloat16)
    k_out = torch.full((5, 8, 128), 3.0, dtype=torch.bfloat16)
    positions = torch.arange(5)
    q_weight = torch.ones(128, dtype=torch.bfloat16)
    k_weight = torch.ones(128, dtype=torch.bfloat16)
    cos_sin = torch.randn(64, 128)
    slots = torch.tensor([3, 4, 5, -1, 9])
    impl.do_qk_norm_rope_kvcache_update(
        layer,
        qkv,
        q_out,
        k_out,
        positions,
        q_weight,
        k_weight,
        1e-5,
        cos_sin,
        False,
        kv_cache,
        slots,
    )
    ((args, kw),) = _calls(fused_kernel, "fused")
    qkv_in, pos_in, slot_in, cos_in, key_cache, value_cache, q_arg = args
    assert qkv_in is qkv and pos_in is positions and slot_in is slots
    assert cos_in is cos_sin
    assert key_cache.shape == (8, 64, 8, 128)
    assert key_cache.dtype == (FP8 if fp8 else torch.bfloat16)
    assert key_cache.data_ptr() == kv_cache.data_ptr()
    assert value_cache.data_ptr() == kv_cache.data_ptr() + 128 * kv_cache.element_size()
    assert q_arg.data_ptr() == q_out.data_ptr() and q_arg.shape == (5, 32, 128)
    assert kw["q_norm_weight"] is q_weight and kw["k_norm_weight"] is k_weight
    assert kw["eps"] == 1e-5 and kw["is_neox"] is False
    assert kw["norm_policy"] == hpc_attn.QkNormPolicy.NORM_THEN_ROPE
    if fp8:
        assert kw["k_scale"].data_ptr() == layer._k_scale.data_ptr()
        assert kw["v_scale"].data_ptr() == layer._v_scale.data_ptr()
    else:
        assert kw["k_scale"] is None and kw["v_scale"] is None
    # K goes to the cache only.
    assert torch.equal(k_out, torch.full_like(k_out, 3.0))


def test_rope_kvcache_hook_packs_inputs_and_writes_query(monkeypatch):
    impl = Impl(32, 128, 0.1, 8)
    assert impl.fused_rope_kvcache_supported() is True
    seen: dict[str, Any] = {}

    def fake_kernel(qkv, positions, slots, cos_sin, kc, vc, q_out, **kw):
        seen.update(qkv=qkv.clone(), kw=kw)
        q_out.copy_(qkv[:, : 32 * 128].view_as(q_out) * 2)

    monkeypatch.setattr(hpc_attn, "rope_norm_store_kv", fake_kernel)
    qkv = torch.randn(4, 48 * 128).to(torch.bfloat16)
    # Non-contiguous views of one projection output, as the model splits it.
    query, key, value = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    original_q = query.clone()
    impl.do_rope_and_kv_cache_update(
        _layer_stub(),
        query,
        key,
        value,
        torch.arange(4),
        torch.randn(64, 128),
        True,
        _kv_cache(False),
        torch.arange(4),
    )
    assert torch.equal(seen["qkv"], torch.cat((original_q, key, value), dim=-1))
    assert seen["kw"]["norm_policy"] == hpc_attn.QkNormPolicy.NONE
    assert seen["kw"]["is_neox"] is True
    # Q is rotated in place, into the caller's (strided) tensor.
    assert torch.equal(query, original_q * 2)


# ---------------------------------------------------------------------------
# Through vLLM's Attention layer
# ---------------------------------------------------------------------------


def _layer_context(layer, md) -> ForwardContext:
    return ForwardContext(
        no_compile_layers={layer.layer_name: layer},
        attn_metadata={layer.layer_name: md},
        slot_mapping={layer.layer_name: md.slot_mapping},
    )


def test_attention_layer_writes_kv_then_attends(kernels, llama_model):
    config = _vllm_config(llama_model)
    layer = _attention(config, 32, 8, 128)
    layer.kv_cache = _kv_cache(False)
    md = _builder(llama_model).build(0, _Inputs().common([1, 3], [5, 3]))
    q = torch.randn(4, 32 * 128).to(torch.bfloat16)
    k = torch.randn(4, 8 * 128).to(torch.bfloat16)
    v = torch.randn(4, 8 * 128).to(torch.bfloat16)
    with (
        set_current_vllm_config(config),
        override_forward_context(_layer_context(layer, md)),
    ):
        out = layer(q, k, v)
    assert [n for n, _, _ in kernels] == ["write", "decode", "prefill"]
    assert out.shape == (4, 32 * 128) and out.dtype == torch.bfloat16
    ((wargs, _),) = _calls(kernels, "write")
    assert wargs[4] is md.slot_mapping
    assert wargs[6] is layer._k_scale


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_attention_layer_after_prologue_as_hy_v3_calls_it(
    kernels, llama_model, kv_cache_dtype
):
    # The call sequence of models/hy_v3.py: the prologue op writes K/V (and
    # FP8 Q with its scales), then attn(q, None, None, None, model dtype).
    fp8 = kv_cache_dtype != "auto"
    config = _vllm_config(llama_model, kv_cache_dtype=kv_cache_dtype)
    layer = _attention(config, 32, 8, 128)
    assert layer.query_quant is None
    with set_current_vllm_config(config):
        # Registers itself for the op under the layer's name.
        prologue = _prologue(layer.layer_name, kv_cache_dtype)
        builder = Builder(_spec(kv_cache_dtype), [], config, torch.device("cpu"))
    assert rope_norm._hpc_rope_norm_instances[layer.layer_name] is prologue
    layer.kv_cache = _kv_cache(fp8)
    md = builder.build(0, _Inputs().common([1, 1, 4], [7, 9, 4]))
    qkv = torch.randn(6, 48 * 128).to(torch.bfloat16)
    _, k_raw, v_raw = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q = torch.empty(6, 32, 128, dtype=FP8 if fp8 else torch.bfloat16)
    with (
        set_current_vllm_config(config),
        override_forward_context(_layer_context(layer, md)),
    ):
        rope_norm.hpc_rope_norm_forward(qkv, q, layer.layer_name)
        out = layer(q.view(6, -1), None, None, None, torch.bfloat16)
    assert [n for n, _, _ in kernels] == ["prologue", "decode", "prefill"]
    assert out.dtype == torch.bfloat16
    ((dargs, dkw),) = _calls(kernels, "decode")
    assert dargs[0].dtype == q.dtype
    if fp8:
        assert builder.q_scale_buffer is not None
        assert dkw["q_scale"].data_ptr() == builder.q_scale_buffer.data_ptr()
    else:
        assert dkw["q_scale"] is None
    assert md.hpc_decode_q_scale is None and md.hpc_prefill_q_scale is None


def test_rope_hook_reads_the_projection_in_place() -> None:
    # Q, K and V split from one projection output are packed by a view (the
    # fusion hook copies nothing); anything else is packed by a copy.
    tokens, hq, hkv, d = 5, 8, 2, 16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    packed = hpc_attn._packed_qkv(q.view(tokens, hq, d), k.view(tokens, hkv, d), v)
    assert packed.data_ptr() == qkv.data_ptr()
    assert torch.equal(packed, qkv)
    copied = hpc_attn._packed_qkv(q.clone(), k, v)
    assert copied.data_ptr() != qkv.data_ptr()
    assert torch.equal(copied, qkv)
    swapped = hpc_attn._packed_qkv(v, k, q)
    assert torch.equal(swapped, torch.cat([v, k, q], dim=-1))


def _positions_loop(
    seq_lens: list[int],
    decode_query_lens: list[int],
    prefill_query_lens: list[int],
    num_tokens: int,
) -> list[int]:
    """Reference: walk the requests token by token."""
    out = []
    for r, qlen in enumerate(decode_query_lens + prefill_query_lens):
        for i in range(qlen):
            out.append(seq_lens[r] - qlen + i)
    out += [0] * (num_tokens - len(out))
    return out


def _cumsum0(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


# ---------------------------------------------------------------------------
# Position derivation
# ---------------------------------------------------------------------------


def test_derive_positions_hand_computed():
    # Two decodes (seq_lens 5 and 9), then prefills of 3 new tokens (nothing
    # cached) and 4 new tokens (6 cached), then two padding tokens.
    seq_lens = torch.tensor([5, 9, 3, 10, 0], dtype=torch.int32)
    positions = hpc_attn.derive_positions(
        seq_lens,
        11,
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([0, 3, 7], dtype=torch.int32),
        2,
    )
    assert positions.dtype == torch.int64
    assert positions.tolist() == [4, 8, 0, 1, 2, 6, 7, 8, 9, 0, 0]


def test_derive_positions_multi_token_decode():
    positions = hpc_attn.derive_positions(
        torch.tensor([7, 3], dtype=torch.int32),
        4,
        torch.tensor([0, 2, 4], dtype=torch.int32),
        None,
        4,
    )
    assert positions.tolist() == [5, 6, 1, 2]


def test_derive_positions_prefill_only_and_empty():
    positions = hpc_attn.derive_positions(
        torch.tensor([4, 2], dtype=torch.int32),
        6,
        None,
        torch.tensor([0, 4, 6], dtype=torch.int32),
        0,
    )
    assert positions.tolist() == [0, 1, 2, 3, 0, 1]
    empty = hpc_attn.derive_positions(
        torch.zeros(0, dtype=torch.int32), 3, None, None, 0
    )
    assert empty.tolist() == [0, 0, 0]


def test_derive_positions_rejects_short_seq_lens():
    with pytest.raises(ValueError, match="seq_lens"):
        hpc_attn.derive_positions(
            torch.tensor([4], dtype=torch.int32),
            2,
            torch.tensor([0, 1, 2], dtype=torch.int32),
            None,
            2,
        )


@pytest.mark.parametrize("seed", range(20))
def test_derive_positions_random(seed):
    rng = random.Random(seed)
    num_decodes = rng.randint(0, 6)
    num_prefills = rng.randint(0, 6)
    dql = rng.randint(1, 4)
    decode_q = [dql] * num_decodes
    prefill_q = [rng.randint(1, 40) for _ in range(num_prefills)]
    seq_lens = [q + rng.randint(0, 300) for q in decode_q + prefill_q]
    num_real = sum(decode_q) + sum(prefill_q)
    num_tokens = num_real + rng.randint(0, 5)
    seq_lens_t = torch.tensor(seq_lens + [0] * rng.randint(0, 3), dtype=torch.int32)

    positions = hpc_attn.derive_positions(
        seq_lens_t,
        num_tokens,
        _cumsum0(decode_q) if num_decodes else None,
        _cumsum0(prefill_q) if num_prefills else None,
        sum(decode_q),
    )
    assert positions.tolist() == _positions_loop(
        seq_lens, decode_q, prefill_q, num_tokens
    )
