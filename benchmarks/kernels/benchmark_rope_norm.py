# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark of the fused attention prologue ``rope_norm_store_kv`` (W4).

Workload W4: tokens {1, 8, 64, 256, 4096, 16384}, as one-token decode
requests (each token its own request at a random long-context position) and
as 1024-token prefills (``ceil(T / 1024)`` requests; below 1024 tokens one
partial request); head configs ``tp1`` (64 q / 8 kv heads) and ``tp8``
(8 q / 1 kv head); head size 128; block size 64; KV cache bf16 (Q out bf16)
or fp8_e4m3 (Q out fp8 with per-token-per-head scales). The Hy3 policy:
QK-RMSNorm then NeoX RoPE over the full head, fp32 norm weights, fp32
``cos_sin_cache``, the HPC_ATTN cache layout.

Protocol: every implementation runs as CUDA-graph replays timed one by one
with CUDA events; warm-up, then the median of at least 50. One graph is
captured per input set (qkv, positions, slots, caches, outputs) and the sets
are replayed round-robin; there are at least 4 sets and, up to 64, enough to
make 240 MB. When the bytes the rotation touches are still under four times
the L2 cache, L2 is scrubbed by reading a buffer of that size before each
timed replay (outside the timed region). The device-to-device copy bandwidth
measured in the same run gives the floor: the fewest bytes the op must move
(qkv read once, Q written, K/V cache rows written, Q scales) / bandwidth.

Baselines, timed the same way on the same inputs:

* ``torch-unfused``: separate PyTorch ops in the model dtype (split, per-head
  RMSNorm, RoPE, index_put into the cache, FP8 quantisation);
* ``torch-compile``: the same norm/RoPE/quantisation compiled by
  ``torch.compile`` with the cache write left eager, as vLLM does with its
  custom cache op;
* ``vllm`` (vLLM's unfused custom ops: ``rms_norm``, ``rotary_embedding``,
  ``reshape_and_cache_flash``, ``scaled_fp8_quant``) and ``vllm-fused``
  (``fused_qknorm_rope_cache``), only where vLLM's compiled ops load.

Every implementation's output is checked against a float32 computation
before it is timed; a baseline that fails is left out, a failing ``hpc``
result fails the run. Results go to
``benchmarks/results/benchmark_rope_norm.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from bench_utils import (
    L2Scrub,
    capture_graphs,
    finish_run,
    import_hpc_ops,
    measure_copy_bandwidth_gbps,
    ratios_over,
    significant,
    time_graphs,
    unavailable_reason,
    validated_op,
)

RESULT_NAME = Path(__file__).stem + ".json"

WORKLOAD = "W4"
TOKENS = (1, 8, 64, 256, 4096, 16384)
QUICK_TOKENS = (1, 64, 4096)
MODES = ("decode", "prefill")
HEAD_CONFIGS = {"tp1": (64, 8), "tp8": (8, 1)}
HEAD_SIZE = 128
BLOCK_SIZE = 64
PREFILL_LEN = 1024
MAX_POSITION = 131072
MIN_DECODE_CONTEXT = 4096
EPS = 1e-6
NORM_THEN_ROPE = 2
KV_SCALE = 0.02
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

ROTATION_BYTES = 240 * 10**6
MIN_SETS = 4
MAX_SETS = 64
MIN_ITERS = 50

HPC = "hpc"
BASELINES = ("torch-unfused", "torch-compile", "vllm", "vllm-fused")


# ---------------------------------------------------------------------------
# Cases and inputs
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    tp: str
    fp8: bool
    tokens: int
    mode: str

    @property
    def name(self) -> str:
        cache = "fp8" if self.fp8 else "bf16"
        return f"{self.tp}-{cache}-t{self.tokens}-{self.mode}"

    @property
    def heads(self) -> tuple[int, int]:
        return HEAD_CONFIGS[self.tp]

    @property
    def width(self) -> int:
        hq, hkv = self.heads
        return (hq + 2 * hkv) * HEAD_SIZE

    def floor_bytes(self) -> int:
        """Fewest bytes the op moves: qkv in, Q (+ scales) and K/V out."""
        hq, hkv = self.heads
        out_size = 1 if self.fp8 else 2
        qkv = self.tokens * self.width * 2
        q_out = self.tokens * hq * HEAD_SIZE * out_size
        kv = 2 * self.tokens * hkv * HEAD_SIZE * out_size
        q_scale = self.tokens * hq * 4 if self.fp8 else 0
        return qkv + q_out + kv + q_scale


def positions_and_slots(
    case: Case, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Positions, slots and the number of cache blocks for one input set.

    decode: every token is its own request with a random long context, in
    its own cache block. prefill: requests of 1024 tokens (the last, or only,
    one shorter) from position 0, each in its own shuffled blocks.
    """
    t = case.tokens
    if case.mode == "decode":
        positions = torch.randint(MIN_DECODE_CONTEXT, MAX_POSITION, (t,), generator=gen)
        blocks = torch.randperm(t, generator=gen)
        slots = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        return positions, slots, t
    lengths = [PREFILL_LEN] * (t // PREFILL_LEN)
    if t % PREFILL_LEN:
        lengths.append(t % PREFILL_LEN)
    blocks_per_request = [math.ceil(n / BLOCK_SIZE) for n in lengths]
    num_blocks = sum(blocks_per_request)
    block_ids = torch.randperm(num_blocks, generator=gen)
    positions, slots, first = [], [], 0
    for n, nb in zip(lengths, blocks_per_request, strict=True):
        pos = torch.arange(n)
        table = block_ids[first : first + nb]
        first += nb
        positions.append(pos)
        slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    return torch.cat(positions), torch.cat(slots), num_blocks


@dataclasses.dataclass
class Shared:
    """Model constants shared by every input set of a case."""

    cos_sin_cache: torch.Tensor  # fp32 [MAX_POSITION, HEAD_SIZE]
    cos_sin_model: torch.Tensor  # bf16 copy for ops that want the model dtype
    q_norm_weight: torch.Tensor  # fp32 [HEAD_SIZE]
    k_norm_weight: torch.Tensor
    k_scale: torch.Tensor  # fp32 [1]
    v_scale: torch.Tensor


def make_shared() -> Shared:
    inv_freq = 1.0 / (
        10000.0 ** (torch.arange(0, HEAD_SIZE, 2, dtype=torch.float) / HEAD_SIZE)
    )
    freqs = torch.einsum(
        "i,j -> ij", torch.arange(MAX_POSITION, dtype=torch.float), inv_freq
    )
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).cuda()
    gen = torch.Generator().manual_seed(1)
    return Shared(
        cos_sin_cache=cos_sin,
        cos_sin_model=cos_sin.bfloat16(),
        q_norm_weight=(torch.rand(HEAD_SIZE, generator=gen) + 0.5).cuda(),
        k_norm_weight=(torch.rand(HEAD_SIZE, generator=gen) + 0.5).cuda(),
        k_scale=torch.tensor([KV_SCALE], device="cuda"),
        v_scale=torch.tensor([KV_SCALE], device="cuda"),
    )


@dataclasses.dataclass
class InputSet:
    qkv: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    kv_cache: torch.Tensor  # (num_blocks, Hkv, block_size, 2 * D)
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D] views
    value_cache: torch.Tensor
    q_out: torch.Tensor
    q_scale: torch.Tensor | None

    def nbytes(self) -> int:
        tensors = [
            self.qkv,
            self.positions,
            self.slot_mapping,
            self.kv_cache,
            self.q_out,
        ]
        if self.q_scale is not None:
            tensors.append(self.q_scale)
        return sum(t.numel() * t.element_size() for t in tensors)

    def poison(self) -> None:
        for t in (self.q_out, self.kv_cache, self.q_scale):
            if t is not None:
                t.view(torch.uint8).fill_(0xFF)


def make_input_set(case: Case, seed: int) -> InputSet:
    hq, hkv = case.heads
    gen = torch.Generator().manual_seed(seed)
    positions, slots, num_blocks = positions_and_slots(case, gen)
    cuda_gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(
        case.tokens, case.width, generator=cuda_gen, device="cuda", dtype=torch.bfloat16
    )
    cache_dtype = FP8 if case.fp8 else torch.bfloat16
    kv_cache = torch.zeros(
        num_blocks, hkv, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=cache_dtype, device="cuda"
    )
    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    q_out = torch.empty(case.tokens, hq, HEAD_SIZE, dtype=cache_dtype, device="cuda")
    q_scale = None
    if case.fp8:
        q_scale = torch.empty(case.tokens, hq, dtype=torch.float32, device="cuda")
    return InputSet(
        qkv=qkv,
        positions=positions.cuda(),
        slot_mapping=slots.cuda(),
        kv_cache=kv_cache,
        key_cache=key_cache,
        value_cache=value_cache,
        q_out=q_out,
        q_scale=q_scale,
    )


# ---------------------------------------------------------------------------
# Implementations: each runs one input set, writing q_out, q_scale, caches
# ---------------------------------------------------------------------------

Impl = Callable[[InputSet], None]


def make_hpc(case: Case, shared: Shared, hpc_ops: ModuleType) -> Impl:
    rope_norm_store_kv = validated_op("rope_norm_store_kv", hpc_ops)

    def run(s: InputSet) -> None:
        rope_norm_store_kv(
            s.qkv,
            s.positions,
            s.slot_mapping,
            shared.cos_sin_cache,
            s.key_cache,
            s.value_cache,
            s.q_out,
            q_scale=s.q_scale,
            q_norm_weight=shared.q_norm_weight,
            k_norm_weight=shared.k_norm_weight,
            k_scale=shared.k_scale if case.fp8 else None,
            v_scale=shared.v_scale if case.fp8 else None,
            eps=EPS,
            norm_policy=NORM_THEN_ROPE,
            is_neox=True,
        )

    return run


def _split_heads(
    qkv: torch.Tensor, hq: int, hkv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * HEAD_SIZE, hkv * HEAD_SIZE, hkv * HEAD_SIZE], dim=-1)
    return (
        q.view(t, hq, HEAD_SIZE),
        k.view(t, hkv, HEAD_SIZE),
        v.view(t, hkv, HEAD_SIZE),
    )


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    # vLLM's RMSNorm.forward_native: statistics in fp32, result in the model
    # dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return (xf * weight).to(dtype)


def _rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def prologue_math(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm then NeoX RoPE of Q and K, in ``dtype`` between the steps."""
    q, k, v = _split_heads(qkv, num_q_heads, num_kv_heads)
    q = _rms_norm(q, q_norm_weight, dtype)
    k = _rms_norm(k, k_norm_weight, dtype)
    cos, sin = cos_sin_cache.index_select(0, positions).to(dtype).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rope_neox(q, cos, sin), _rope_neox(k, cos, sin), v.to(dtype)


def _write_cache(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    if cache.dtype == FP8:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache[block, offset] = rows


def _store_q(s: InputSet, q: torch.Tensor) -> None:
    if s.q_scale is None:
        s.q_out.copy_(q)
        return
    scale = q.float().abs().amax(dim=-1) / FP8_MAX
    s.q_out.copy_(_quant_fp8(q, scale.unsqueeze(-1)))
    s.q_scale.copy_(scale)


def make_torch_unfused(case: Case, shared: Shared) -> Impl:
    hq, hkv = case.heads

    def run(s: InputSet) -> None:
        q, k, v = prologue_math(
            s.qkv,
            s.positions,
            shared.cos_sin_cache,
            shared.q_norm_weight,
            shared.k_norm_weight,
            hq,
            hkv,
            torch.bfloat16,
        )
        if case.fp8:
            k = _quant_fp8(k, shared.k_scale)
            v = _quant_fp8(v, shared.v_scale)
        _write_cache(s.key_cache, s.slot_mapping, k)
        _write_cache(s.value_cache, s.slot_mapping, v)
        _store_q(s, q)

    return run


_COMPILED: dict[bool, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def _compiled_prologue(fp8: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    if fp8 not in _COMPILED:

        def fn(
            qkv: torch.Tensor,
            positions: torch.Tensor,
            cos_sin_cache: torch.Tensor,
            q_norm_weight: torch.Tensor,
            k_norm_weight: torch.Tensor,
            k_scale: torch.Tensor,
            v_scale: torch.Tensor,
            q_out: torch.Tensor,
            q_scale: torch.Tensor | None,
            num_q_heads: int,
            num_kv_heads: int,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            q, k, v = prologue_math(
                qkv,
                positions,
                cos_sin_cache,
                q_norm_weight,
                k_norm_weight,
                num_q_heads,
                num_kv_heads,
                torch.bfloat16,
            )
            if q_scale is None:
                q_out.copy_(q)
            else:
                scale = q.float().abs().amax(dim=-1) / FP8_MAX
                q_out.copy_(_quant_fp8(q, scale.unsqueeze(-1)))
                q_scale.copy_(scale)
            if fp8:
                return _quant_fp8(k, k_scale), _quant_fp8(v, v_scale)
            return k, v

        _COMPILED[fp8] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _COMPILED[fp8]


def make_torch_compile(case: Case, shared: Shared) -> Impl:
    hq, hkv = case.heads
    compiled = _compiled_prologue(case.fp8)

    def run(s: InputSet) -> None:
        k, v = compiled(
            s.qkv,
            s.positions,
            shared.cos_sin_cache,
            shared.q_norm_weight,
            shared.k_norm_weight,
            shared.k_scale,
            shared.v_scale,
            s.q_out,
            s.q_scale,
            hq,
            hkv,
        )
        _write_cache(s.key_cache, s.slot_mapping, k)
        _write_cache(s.value_cache, s.slot_mapping, v)

    return run


def _vllm_custom_ops() -> ModuleType | None:
    try:
        from vllm import _custom_ops as ops

        torch.ops._C.rms_norm  # noqa: B018 - raises when the library is absent
        torch.ops._C_cache_ops.reshape_and_cache_flash  # noqa: B018
    except Exception:  # noqa: BLE001 - vLLM absent or its ops do not load
        return None
    return ops


def make_vllm(case: Case, shared: Shared) -> Impl | None:
    ops = _vllm_custom_ops()
    if ops is None:
        return None
    hq, hkv = case.heads
    q_w = shared.q_norm_weight.bfloat16()
    k_w = shared.k_norm_weight.bfloat16()
    kv_dtype = "fp8" if case.fp8 else "auto"

    def run(s: InputSet) -> None:
        t = s.qkv.shape[0]
        q, k, v = _split_heads(s.qkv, hq, hkv)
        qn = s.q_out if not case.fp8 else torch.empty_like(q)
        kn = torch.empty_like(k)
        ops.rms_norm(qn, q, q_w, EPS)
        ops.rms_norm(kn, k, k_w, EPS)
        ops.rotary_embedding(
            s.positions,
            qn.view(t, hq * HEAD_SIZE),
            kn.view(t, hkv * HEAD_SIZE),
            HEAD_SIZE,
            shared.cos_sin_model,
            True,
        )
        ops.reshape_and_cache_flash(
            kn,
            v,
            s.key_cache,
            s.value_cache,
            s.slot_mapping,
            kv_dtype,
            shared.k_scale,
            shared.v_scale,
        )
        if s.q_scale is not None:
            _, scale = ops.scaled_fp8_quant(
                qn.view(t * hq, HEAD_SIZE),
                use_per_token_if_dynamic=True,
                output=s.q_out.view(t * hq, HEAD_SIZE),
            )
            s.q_scale.copy_(scale.view(t, hq))

    return run


def make_vllm_fused(case: Case, shared: Shared) -> Impl | None:
    ops = _vllm_custom_ops()
    if ops is None or not hasattr(ops, "fused_qknorm_rope_cache"):
        return None
    hq, hkv = case.heads
    kv_dtype = "fp8" if case.fp8 else "auto"

    def run(s: InputSet) -> None:
        q, _, _ = ops.fused_qknorm_rope_cache(
            s.qkv,
            shared.q_norm_weight,
            shared.k_norm_weight,
            shared.cos_sin_cache,
            s.positions,
            s.slot_mapping,
            s.key_cache,
            s.value_cache,
            hq,
            hkv,
            HEAD_SIZE,
            HEAD_SIZE,
            EPS,
            0.0,
            kv_dtype,
            shared.k_scale,
            shared.v_scale,
        )
        _store_q(s, q.view(-1, hq, HEAD_SIZE))

    return run


# ---------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def check_impl(case: Case, shared: Shared, s: InputSet, impl: Impl) -> str | None:
    """Run ``impl`` on poisoned outputs; None if it matches float32 math."""
    hq, hkv = case.heads
    s.poison()
    impl(s)
    torch.accelerator.synchronize()
    q, k, v = prologue_math(
        s.qkv,
        s.positions,
        shared.cos_sin_cache,
        shared.q_norm_weight,
        shared.k_norm_weight,
        hq,
        hkv,
        torch.float32,
    )
    slots = s.slot_mapping
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    raw = (lambda c: c.view(torch.uint8)) if case.fp8 else (lambda c: c)
    k_out = raw(s.key_cache)[block, offset]
    v_out = raw(s.value_cache)[block, offset]
    if case.fp8:
        assert s.q_scale is not None
        q_got = s.q_out.float() * s.q_scale.unsqueeze(-1)
        k_got = k_out.view(FP8).float() * shared.k_scale
        v_got = v_out.view(FP8).float() * shared.v_scale
        tol = 5e-2
    else:
        q_got, k_got, v_got = s.q_out.float(), k_out.float(), v_out.float()
        tol = 2e-2
    errors = {"q": _rel(q_got, q), "k": _rel(k_got, k), "v": _rel(v_got, v)}
    bad = {name: err for name, err in errors.items() if not err <= tol}
    if bad:
        return ", ".join(f"{name} rel error {err:.3g}" for name, err in bad.items())
    return None


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    iters: int
    warmup: int
    check: bool
    baselines: tuple[str, ...]


def bench_case(
    case: Case,
    shared: Shared,
    hpc_ops: ModuleType,
    bandwidth_gbps: float,
    scrub: L2Scrub,
    opts: Options,
) -> list[dict[str, Any]]:
    first = make_input_set(case, seed=0)
    num_sets = min(MAX_SETS, max(MIN_SETS, math.ceil(ROTATION_BYTES / first.nbytes())))
    sets = [first] + [make_input_set(case, seed=i) for i in range(1, num_sets)]
    touched = num_sets * case.floor_bytes()
    use_scrub = scrub if touched < 4 * scrub.l2_bytes else None

    impls: dict[str, Impl] = {HPC: make_hpc(case, shared, hpc_ops)}
    makers: dict[str, Callable[[], Impl | None]] = {
        "torch-unfused": lambda: make_torch_unfused(case, shared),
        "torch-compile": lambda: make_torch_compile(case, shared),
        "vllm": lambda: make_vllm(case, shared),
        "vllm-fused": lambda: make_vllm_fused(case, shared),
    }
    for name in opts.baselines:
        try:
            impl = makers[name]()
        except Exception as err:  # noqa: BLE001 - a baseline that cannot run
            print(f"  {case.name}: {name} unavailable: {err}")
            continue
        if impl is not None:
            impls[name] = impl

    floor_us = case.floor_bytes() / (bandwidth_gbps * 1e3)
    pool = torch.cuda.graph_pool_handle()
    timings: dict[str, float] = {}
    for name, impl in impls.items():
        try:
            if opts.check or name != HPC:
                problem = check_impl(case, shared, first, impl)
                if problem is not None:
                    if name == HPC:
                        raise SystemExit(f"{case.name}: hpc output is wrong: {problem}")
                    print(f"  {case.name}: {name} left out, wrong output: {problem}")
                    continue
            graphs = capture_graphs(impl, sets, pool)
            timings[name] = time_graphs(graphs, opts.iters, opts.warmup, use_scrub)
            del graphs
        except SystemExit:
            raise
        except Exception as err:  # noqa: BLE001 - a baseline that fails to run
            if name == HPC:
                raise
            print(f"  {case.name}: {name} failed: {type(err).__name__}: {err}")
            torch.accelerator.synchronize()

    records = []
    for name, us in timings.items():
        ratios = ratios_over(timings, HPC) if name == HPC else {}
        records.append(
            {
                "workload": WORKLOAD,
                "case": case.name,
                "impl": name,
                "us": round(us, 2),
                "floor_us": significant(floor_us, 4),
                "fraction_of_floor": significant(floor_us / us, 3),
                "ratios": ratios,
            }
        )
    return records


def all_cases(quick: bool) -> list[Case]:
    tokens = QUICK_TOKENS if quick else TOKENS
    return [
        Case(tp=tp, fp8=fp8, tokens=t, mode=mode)
        for tp in HEAD_CONFIGS
        for fp8 in (False, True)
        for mode in MODES
        for t in tokens
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tokens 1, 64, 4096 only")
    parser.add_argument("--out", type=Path, help="also write the JSON under this dir")
    parser.add_argument("--iters", type=int, default=100, help="timed replays (>= 50)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cases", default="*", help="glob over case names")
    parser.add_argument(
        "--baselines",
        default=None,
        help="comma-separated subset of: "
        + ", ".join(BASELINES)
        + " (default: all; with --quick all but torch-compile)",
    )
    parser.add_argument(
        "--no-check", action="store_true", help="skip checking the hpc output"
    )
    args = parser.parse_args(argv)
    if args.iters < MIN_ITERS:
        parser.error(f"--iters must be at least {MIN_ITERS}")
    if args.baselines is None:
        chosen = [b for b in BASELINES if not (args.quick and b == "torch-compile")]
        args.baselines = ",".join(chosen)
    unknown = set(filter(None, args.baselines.split(","))) - set(BASELINES)
    if unknown:
        parser.error(f"unknown baselines: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"benchmark_rope_norm: not run: {reason}")
        return 1
    hpc_ops = import_hpc_ops()
    opts = Options(
        iters=args.iters,
        warmup=args.warmup,
        check=not args.no_check,
        baselines=tuple(b for b in args.baselines.split(",") if b),
    )
    cases = [c for c in all_cases(args.quick) if fnmatch.fnmatch(c.name, args.cases)]
    if not cases:
        print(f"benchmark_rope_norm: no case matches {args.cases!r}")
        return 1

    bandwidth = measure_copy_bandwidth_gbps()
    print(f"copy bandwidth {bandwidth:.0f} GB/s, {len(cases)} cases")
    shared = make_shared()
    scrub = L2Scrub()

    records: list[dict[str, Any]] = []
    for case in cases:
        case_records = bench_case(case, shared, hpc_ops, bandwidth, scrub, opts)
        records.extend(case_records)
        hpc = case_records[0]
        print(f"  {case.name}: hpc {hpc['us']} us, {hpc['fraction_of_floor']} of floor")
        torch.accelerator.empty_cache()

    finish_run(RESULT_NAME, records, bandwidth, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
