# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests of the HPC_ATTN impl's forward against the float64 reference.

Each case lays out a KV cache the way vLLM 0.33 allocates it (one int8
buffer viewed per layer by ``create_kv_cache_views``, LBNHC or LBHNC, and a
128-token manager block split into 64-token kernel blocks), fills every slot
a kernel must not read with NaN, hands the builder a ``CommonAttentionMetadata``
shaped like the model runner's (decodes first, padding rows, persistent
buffers) and runs ``HpcAttentionImpl.forward`` on the real kernels. The
output of every real row must match ``prefill_reference.reference_prefill``
(decode rows are prefill rows of ``decode_query_len`` tokens) within the
kernel tests' bars.

K/V reach the cache three ways: written by the test before the forward (as
the prologue does, with the hand-off flag set), written by the impl's
``do_kv_cache_update`` through vLLM's ``reshape_and_cache_flash`` (skipped
when vLLM's CUDA library is not loaded), and, for FP8, handed off with FP8
queries and per-token-per-head scales as ``HpcRopeNorm`` produces them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import types
from pathlib import Path

import pytest
import torch

from tests.kernels.hpc.decode_reference import poison_cache_, quantize_fp8
from tests.kernels.hpc.prefill_reference import (
    check_prefill,
    on_fp8_grid,
    reference_prefill,
)
from tests.kernels.hpc.rope_norm_reference import (
    assert_close,
    make_cos_sin_cache,
    read_slots,
    reference_prologue,
)
from tests.kernels.hpc.utils import FP8_DTYPE, raw_view
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import hpc_attn
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    KVQuantMode,
    SlidingWindowSpec,
    create_kv_cache_views,
)

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
DEVICE = "cuda"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    kv_cache_dtype: str = "auto"
    num_spec: int = 0
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 64
    # Manager block size; a multiple of block_size splits into kernel blocks.
    manager_block_size: int | None = None
    layout: KVCacheLayout = KVCacheLayout.LBNHC
    padding_tokens: int = 0
    window: int | None = None
    softcap: float = 0.0
    scale: float | None = None
    fp8_queries: bool = False

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")


CASES = [
    # Mixed: three decodes (one of a single key), an extend, a fresh prefill.
    Case("mixed-bf16", (1, 1, 1, 37, 129), (700, 64, 1, 337, 129), padding_tokens=3),
    Case("mixed-fp8", (1, 1, 1, 37, 129), (700, 64, 1, 337, 129), "fp8_e4m3"),
    Case(
        "mixed-fp8-queries",
        (1, 1, 37, 129),
        (700, 65, 337, 129),
        "fp8",
        fp8_queries=True,
    ),
    # Speculative: uniform 3-token decodes, then a 1-token and a 50-token
    # prefill row.
    Case("spec-bf16", (3, 3, 3, 1, 50), (400, 3, 1000, 77, 50), num_spec=2),
    Case(
        "spec-fp8",
        (4, 4, 1, 9),
        (4000, 130, 77, 300),
        "fp8_e4m3",
        num_spec=3,
        fp8_queries=True,
    ),
    # Seven speculative tokens (8-token decode rows: 32 rows per KV head at
    # GQA 4), then a 9-token prefill row.
    Case("spec7-bf16", (8, 8, 9), (3000, 8, 500), num_spec=7),
    # Chunked prefill: a 256-token chunk after 2000 cached keys, a 1000-token
    # chunk after 3000, and a decode.
    Case("chunked-bf16", (1, 256, 1000), (5000, 2256, 4000)),
    Case("chunked-fp8", (1, 256, 1000), (5000, 2256, 4000), "fp8"),
    # Padded FULL-graph batch: the last request is padding.
    Case("padded-spec", (2, 2, 0), (300, 2, 0), num_spec=1, padding_tokens=2),
    # Shapes: head sizes, GQA ratios, block sizes, layouts.
    Case(
        "head64-gqa16-b16",
        (1, 1, 70),
        (90, 1000, 200),
        num_heads=32,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
    ),
    Case(
        "head256-gqa2-b32-hnd",
        (1, 40),
        (333, 100),
        "fp8",
        num_heads=8,
        num_kv_heads=4,
        head_size=256,
        block_size=32,
        layout=KVCacheLayout.LBHNC,
    ),
    Case("gqa5-tp8", (1, 1, 20), (513, 64, 20), num_heads=5, num_kv_heads=1),
    Case("split128", (1, 1, 90), (300, 129, 400), manager_block_size=128),
    # Window, soft-cap and a scale other than 1/sqrt(D).
    Case(
        "window-softcap",
        (1, 1, 300),
        (2000, 100, 1300),
        window=256,
        softcap=30.0,
        scale=0.05,
    ),
]


def _model_config(tmp_path: Path, case: Case) -> ModelConfig:
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": case.num_heads * case.head_size,
        "intermediate_size": 1024,
        "num_attention_heads": case.num_heads,
        "num_key_value_heads": case.num_kv_heads,
        "head_dim": case.head_size,
        "num_hidden_layers": 1,
        "vocab_size": 1024,
        "max_position_embeddings": 16384,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return ModelConfig(
        model=str(path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192
    )


def _vllm_config(tmp_path: Path, case: Case) -> VllmConfig:
    config = VllmConfig(
        model_config=_model_config(tmp_path, case),
        attention_config=AttentionConfig(backend=AttentionBackendEnum.HPC_ATTN),
        cache_config=CacheConfig(
            block_size=case.manager_block_size or case.block_size,
            cache_dtype=case.kv_cache_dtype,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=4096,
            max_model_len=8192,
            is_encoder_decoder=False,
        ),
    )
    if case.num_spec:
        # The builder reads only these fields.
        object.__setattr__(
            config,
            "speculative_config",
            types.SimpleNamespace(
                num_speculative_tokens=case.num_spec,
                parallel_drafting=False,
                enable_adaptive_verification=False,
            ),
        )
    return config


def _spec(case: Case, block_size: int):
    kwargs = dict(
        block_size=block_size,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        dtype=torch.uint8 if case.fp8 else BF16,
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR if case.fp8 else KVQuantMode.NONE,
    )
    if case.window is not None:
        return SlidingWindowSpec(sliding_window=case.window, **kwargs)
    return FullAttentionSpec(**kwargs)


@dataclasses.dataclass
class Batch:
    kv_cache: torch.Tensor  # the layer's logical [B, H, N, 2D] view
    key_cache: torch.Tensor  # [B, N, H, D] views, FP8 for an FP8 cache
    value_cache: torch.Tensor
    block_table: torch.Tensor  # kernel blocks
    common: CommonAttentionMetadata
    new_keys: torch.Tensor  # [T, Hkv, D] model dtype
    new_values: torch.Tensor
    new_slots: torch.Tensor  # [T] kernel-block slots, -1 for padding


def _make_batch(case: Case, rng: random.Random, k_scale, v_scale) -> Batch:
    device = torch.device(DEVICE)
    gen = torch.Generator(device="cpu").manual_seed(rng.randrange(1 << 30))
    manager = case.manager_block_size or case.block_size
    ratio = manager // case.block_size
    num_reqs = len(case.query_lens)
    blocks_per_req = [math.ceil(s / manager) for s in case.seq_lens]
    # Block 0 is the null block; two spare blocks stay poisoned.
    num_blocks = 1 + sum(blocks_per_req) + 2
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    width = max(blocks_per_req) + 1
    manager_table = torch.zeros(num_reqs, width, dtype=torch.int32)
    at = 0
    for r, n in enumerate(blocks_per_req):
        manager_table[r, :n] = torch.tensor(ids[at : at + n], dtype=torch.int32)
        at += n
        manager_table[r, n:] = ids[-1]  # a spare block past the request's end
        if case.seq_lens[r] == 0:
            manager_table[r] = 0  # padding request: the null block
    table = (
        manager_table.unsqueeze(-1) * ratio + torch.arange(ratio, dtype=torch.int32)
    ).flatten(1)

    spec = _spec(case, manager)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * num_blocks,
        layers=["layer"],
        layer_stride=page * num_blocks,
        block_stride=page,
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8, device=device)
    (kv_cache,) = create_kv_cache_views(
        raw,
        spec,
        num_blocks,
        case.layout,
        tensor,
        kernel_block_size=case.block_size if ratio > 1 else None,
    )
    key_cache, value_cache = kv_cache.transpose(1, 2).split(case.head_size, dim=-1)
    if case.fp8:
        key_cache, value_cache = key_cache.view(FP8_DTYPE), value_cache.view(FP8_DTYPE)
    poison_cache_(key_cache)
    poison_cache_(value_cache)

    # Every key of every request, context and new tokens alike, written
    # through integer views (index_put has no FP8 kernels).
    hkv, d, bs = case.num_kv_heads, case.head_size, case.block_size
    raw_k, raw_v = raw_view(key_cache), raw_view(value_cache)
    for r, length in enumerate(case.seq_lens):
        if length == 0:
            continue
        pos = torch.arange(length)
        blk = table[r, pos // bs].long().to(device)
        off = (pos % bs).to(device)
        k = torch.randn(length, hkv, d, generator=gen).to(device)
        v = torch.randn(length, hkv, d, generator=gen).to(device)
        if case.fp8:
            k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
        else:
            k, v = k.to(BF16), v.to(BF16)
        raw_k[blk, off] = raw_view(k)
        raw_v[blk, off] = raw_view(v)

    # The new tokens' K/V as the model hands them to the layer, and their
    # slots (manager and kernel units agree: b * M + o = (b * M / bs + o // bs)
    # * bs + o % bs).
    num_real = sum(case.query_lens)
    num_tokens = num_real + case.padding_tokens
    token_blocks, token_offsets = [], []
    for r, (q_len, length) in enumerate(
        zip(case.query_lens, case.seq_lens, strict=True)
    ):
        for p in range(length - q_len, length):
            token_blocks.append(int(table[r, p // bs]))
            token_offsets.append(p % bs)
    blk = torch.tensor(token_blocks, dtype=torch.long, device=device)
    off = torch.tensor(token_offsets, dtype=torch.long, device=device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    slots[:num_real] = blk * bs + off
    new_keys = torch.zeros(num_tokens, hkv, d, dtype=BF16, device=device)
    new_values = torch.zeros_like(new_keys)
    k_new = raw_k[blk, off].view(key_cache.dtype)
    v_new = raw_v[blk, off].view(value_cache.dtype)
    if case.fp8:
        new_keys[:num_real] = (k_new.float() * k_scale).to(BF16)
        new_values[:num_real] = (v_new.float() * v_scale).to(BF16)
    else:
        new_keys[:num_real] = k_new
        new_values[:num_real] = v_new

    qsl = torch.tensor([0, *torch.tensor(case.query_lens).cumsum(0).tolist()])
    qsl = qsl.to(torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(case.query_lens),
        max_seq_len=max(case.seq_lens),
        block_table_tensor=table.to(device),
        slot_mapping=slots,
        positions=torch.zeros(num_tokens, dtype=torch.int64, device=device),
    )
    return Batch(
        kv_cache,
        key_cache,
        value_cache,
        table.to(device),
        common,
        new_keys,
        new_values,
        slots,
    )


def _queries(case: Case, num_tokens: int, gen: torch.Generator):
    q = torch.randn(num_tokens, case.num_heads, case.head_size, generator=gen)
    if case.fp8_queries:
        # As the prologue emits them: E4M3 values with per-token-per-head
        # scales amax / 448.
        scale = (q.abs().amax(dim=-1) / 448.0).clamp_min(1e-12)
        q8 = (q / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(FP8_DTYPE)
        return q8.to(DEVICE), scale.float().to(DEVICE)
    if case.fp8:
        # Exact in bf16 and fp16 and on the E4M3 grid, whichever way a kernel
        # takes bf16 queries over an FP8 cache.
        return on_fp8_grid(q).to(BF16).to(DEVICE), None
    return q.to(BF16).to(DEVICE), None


def _run(case: Case, tmp_path: Path, *, impl_writes: bool) -> None:
    rng = random.Random(case.name)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k_scale = torch.tensor(0.02 if case.fp8 else 1.0, device=DEVICE)
    v_scale = torch.tensor(0.03 if case.fp8 else 1.0, device=DEVICE)
    batch = _make_batch(case, rng, k_scale, v_scale)
    config = _vllm_config(tmp_path, case)
    with set_current_vllm_config(config):
        builder = hpc_attn.HpcAttnMetadataBuilder(
            _spec(case, case.block_size), [], config, torch.device(DEVICE)
        )
        scale = case.scale or case.head_size**-0.5
        impl = hpc_attn.HpcAttentionImpl(
            case.num_heads,
            case.head_size,
            scale,
            case.num_kv_heads,
            None,
            case.window,
            case.kv_cache_dtype,
            case.softcap or None,
        )
    layer = types.SimpleNamespace(
        layer_name="layer", _k_scale=k_scale.clone(), _v_scale=v_scale.clone()
    )
    md = builder.build(0, batch.common)

    num_tokens = batch.common.num_actual_tokens
    num_real = sum(case.query_lens)
    query, q_scale = _queries(case, num_tokens, gen)
    key = value = None
    if impl_writes:
        # The new tokens' slots are poisoned: only the impl's write fills them.
        real = batch.new_slots[:num_real]
        blk, off = real // case.block_size, real % case.block_size
        for cache in (batch.key_cache, batch.value_cache):
            nan = poison_cache_(torch.empty(1, dtype=cache.dtype, device=DEVICE))
            raw_view(cache)[blk, off] = raw_view(nan)[0]
        key, value = batch.new_keys, batch.new_values
    # Otherwise the prologue wrote K/V (and, for FP8 queries, their scales)
    # and the layer calls attention with key=None, value=None.
    if q_scale is not None:
        md.hpc_decode_q_scale = q_scale[: md.num_decode_tokens]
        md.hpc_prefill_q_scale = q_scale[md.num_decode_tokens :]

    output = torch.full(
        (num_tokens, case.num_heads, case.head_size), float("nan"), dtype=BF16
    ).to(DEVICE)
    if impl_writes:
        # What vLLM's unified_kv_cache_update op does before the attention op.
        impl.do_kv_cache_update(layer, key, value, batch.kv_cache, md.slot_mapping)
    impl.forward(layer, query, key, value, batch.kv_cache, md, output)
    if DEVICE == "cuda":
        torch.accelerator.synchronize()
    assert md.hpc_decode_q_scale is None

    lens = [(q, s) for q, s in zip(case.query_lens, case.seq_lens, strict=True)]
    real_lens = [(q, s) for q, s in lens if q > 0]
    ref = reference_prefill(
        query[:num_real],
        batch.key_cache,
        batch.value_cache,
        batch.block_table[[i for i, (q, _) in enumerate(lens) if q > 0]],
        real_lens,
        scale=scale,
        q_scale=None if q_scale is None else q_scale[:num_real],
        k_scale=k_scale if case.fp8 else None,
        v_scale=v_scale if case.fp8 else None,
        softcap=case.softcap,
        window=case.window or 0,
    )
    check_prefill(
        output[:num_real].double(),
        ref,
        real_lens,
        fp8=case.fp8,
        what=case.name,
    )
    if md.num_decodes and case.padding_tokens and 0 in case.query_lens:
        # Padding requests inside the decode batch get zeros.
        pad = output[num_real : md.num_decode_tokens]
        assert torch.equal(pad, torch.zeros_like(pad)), case.name


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_forward_matches_reference(case: Case, tmp_path: Path):
    _run(case, tmp_path, impl_writes=False)


def _has_vllm_cache_op() -> bool:
    try:
        return hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash")
    except (AttributeError, RuntimeError):
        return False


_WRITE_CASES = [c for c in CASES if not c.fp8_queries and c.name != "padded-spec"]


@pytest.mark.parametrize("case", _WRITE_CASES, ids=[c.name for c in _WRITE_CASES])
def test_forward_writes_kv_and_matches_reference(case: Case, tmp_path: Path):
    if not _has_vllm_cache_op():
        pytest.skip("vLLM's CUDA cache ops (vllm._C) are not loaded")
    _run(case, tmp_path, impl_writes=True)


# ---------------------------------------------------------------------------
# Fusion-pass hooks on the prologue kernel
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("variant", ["qk_norm_rope", "rope"])
def test_fusion_hooks_match_reference(kv_cache_dtype: str, variant: str):
    fp8 = kv_cache_dtype != "auto"
    hq, hkv, d, bs, num_blocks, t = 16, 4, 128, 64, 6, 70
    gen = torch.Generator().manual_seed(7 if fp8 else 3)
    impl = hpc_attn.HpcAttentionImpl(hq, d, d**-0.5, hkv, None, None, kv_cache_dtype)
    assert impl.fused_qk_norm_rope_kvcache_supported()
    assert impl.fused_rope_kvcache_supported()
    layer = types.SimpleNamespace(
        layer_name="fused",
        _k_scale=torch.tensor(0.05, device=DEVICE),
        _v_scale=torch.tensor(0.04, device=DEVICE),
    )
    dtype = torch.uint8 if fp8 else BF16
    kv_cache = torch.zeros(num_blocks, bs, hkv, 2 * d, dtype=dtype, device=DEVICE)
    kv_cache = kv_cache.transpose(1, 2)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(BF16).to(DEVICE)
    positions = torch.randint(0, 4000, (t,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t].to(DEVICE)
    slots[5] = -1  # a padding token
    cos_sin = make_cos_sin_cache(d, 4096, device=DEVICE)
    q_weight = (1 + 0.1 * torch.randn(d, generator=gen)).to(BF16).to(DEVICE)
    k_weight = (1 + 0.1 * torch.randn(d, generator=gen)).to(BF16).to(DEVICE)

    if variant == "qk_norm_rope":
        q_out = torch.empty(t, hq, d, dtype=BF16, device=DEVICE)
        k_out = torch.empty(t, hkv, d, dtype=BF16, device=DEVICE)
        impl.do_qk_norm_rope_kvcache_update(
            layer,
            qkv,
            q_out,
            k_out,
            positions,
            q_weight,
            k_weight,
            1e-6,
            cos_sin,
            True,
            kv_cache,
            slots,
        )
        ref = reference_prologue(
            qkv,
            positions,
            cos_sin,
            hq,
            hkv,
            d,
            q_norm_weight=q_weight,
            k_norm_weight=k_weight,
            eps=1e-6,
            norm_policy=int(hpc_attn.QkNormPolicy.NORM_THEN_ROPE),
        )
        q_result = q_out
    else:
        query, key, value = qkv.clone().split([hq * d, hkv * d, hkv * d], dim=-1)
        impl.do_rope_and_kv_cache_update(
            layer, query, key, value, positions, cos_sin, True, kv_cache, slots
        )
        ref = reference_prologue(qkv, positions, cos_sin, hq, hkv, d)
        q_result = query.reshape(t, hq, d)
    if DEVICE == "cuda":
        torch.accelerator.synchronize()

    assert_close(q_result.float(), ref.q, 1e-2, f"{variant} q")
    key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
    if fp8:
        key_cache, value_cache = key_cache.view(FP8_DTYPE), value_cache.view(FP8_DTYPE)
    real = slots >= 0
    k_read = read_slots(key_cache, slots[real]).float()
    v_read = read_slots(value_cache, slots[real]).float()
    rtol = 3e-2 if fp8 else 1e-2
    if fp8:
        k_read, v_read = k_read * layer._k_scale, v_read * layer._v_scale
    assert_close(k_read, ref.k[real], rtol, f"{variant} k")
    assert_close(v_read, ref.v[real], rtol, f"{variant} v")


# ---------------------------------------------------------------------------
# FULL CUDA graph: captured once, replayed after build() planned a new step
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_spec", [0, 2])
def test_full_graph_replays_the_next_steps_plan(tmp_path: Path, num_spec: int):
    dql = num_spec + 1
    num_reqs = 6
    long_lens = (
        (3000, 65, 700, 1, 128, 4100) if dql == 1 else (3000, 65, 700, 3, 128, 4100)
    )
    case = Case(
        f"graph-q{dql}",
        (dql,) * num_reqs,
        long_lens,
        "fp8_e4m3",
        num_spec=num_spec,
    )
    rng = random.Random(case.name)
    gen = torch.Generator().manual_seed(11)
    k_scale = torch.tensor(0.02, device=DEVICE)
    v_scale = torch.tensor(0.03, device=DEVICE)
    # Every key of the longer step is in the cache; the capture step sees a
    # shorter prefix of each sequence.
    batch = _make_batch(case, rng, k_scale, v_scale)
    short_lens = [max(dql, s // 3) for s in long_lens]
    config = _vllm_config(tmp_path, case)
    with set_current_vllm_config(config):
        builder = hpc_attn.HpcAttnMetadataBuilder(
            _spec(case, case.block_size), [], config, torch.device(DEVICE)
        )
        impl = hpc_attn.HpcAttentionImpl(
            case.num_heads,
            case.head_size,
            case.head_size**-0.5,
            case.num_kv_heads,
            None,
            None,
            case.kv_cache_dtype,
        )
    layer = types.SimpleNamespace(
        layer_name="graph", _k_scale=k_scale, _v_scale=v_scale
    )
    common = batch.common
    persistent_lens = common.seq_lens  # the runner's persistent buffer
    persistent_lens.copy_(torch.tensor(short_lens, dtype=torch.int32))
    md_capture = builder.build_for_cudagraph_capture(common)
    assert md_capture.num_decodes == num_reqs and md_capture.decode_query_len == dql

    num_tokens = num_reqs * dql
    query, _ = _queries(case, num_tokens, gen)
    output = torch.zeros(num_tokens, case.num_heads, case.head_size, dtype=BF16)
    output = output.to(DEVICE)

    def step(md) -> None:
        impl.forward(layer, query, None, None, batch.kv_cache, md, output)

    if DEVICE == "cuda":
        step(md_capture)  # warm-up outside the graph
        torch.accelerator.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(md_capture)
    # The next step: new lengths in the same buffers, planned by build().
    persistent_lens.copy_(torch.tensor(long_lens, dtype=torch.int32))
    md_next = builder.build(0, common)
    assert md_next.decode_seq_lens is not None
    assert md_capture.decode_seq_lens is not None
    assert md_next.decode_seq_lens.data_ptr() == md_capture.decode_seq_lens.data_ptr()
    assert md_next.decode_workspace is md_capture.decode_workspace
    output.fill_(float("nan"))
    if DEVICE == "cuda":
        graph.replay()
        torch.accelerator.synchronize()
    else:
        step(md_next)

    lens = [(dql, s) for s in long_lens]
    ref = reference_prefill(
        query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        lens,
        scale=case.head_size**-0.5,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    check_prefill(output.double(), ref, lens, fp8=True, what=case.name)
