# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of the MoE benchmark: the ``triton_gemms`` input preparation
(the routing alignment it hands vLLM's Triton kernel and the 1x128
activation quantization), the floors (FLOP count, the larger of the byte and
FLOP floors, the fp8 rate's fallback), the ``fused_experts`` baseline's
argument and its skip without vLLM's compiled ops, and the case names."""

from __future__ import annotations

import inspect
import math
import sys
from pathlib import Path

import pytest
import regex as re
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "kernels"))
import bench_utils  # noqa: E402
import benchmark_hpc_moe as bench  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "DEVICE", "cpu")


def _random_slots(tokens: int, topk: int, experts: int, seed: int) -> torch.Tensor:
    """Local expert of each (token, choice), -1 for some (off this rank);
    distinct per token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts + 4, generator=gen).argsort(dim=1)[:, :topk]
    return torch.where(ids < experts, ids, torch.full_like(ids, -1))


@pytest.mark.parametrize(
    "tokens, topk, experts, block_m",
    [(1, 8, 24, 16), (5, 2, 3, 4), (64, 8, 24, 16), (257, 8, 192, 64)],
)
def test_align_routing(tokens: int, topk: int, experts: int, block_m: int) -> None:
    slots = _random_slots(tokens, topk, experts, seed=tokens + experts)
    sorted_ids, expert_ids, padded = bench.align_routing(slots, block_m, experts)
    flat = slots.flatten()
    sentinel = flat.numel()
    counts = torch.bincount(flat[flat >= 0], minlength=experts)
    expected = sum(math.ceil(int(c) / block_m) * block_m for c in counts)
    assert int(padded) == expected
    assert sorted_ids.numel() == sentinel + experts * (block_m - 1)
    blocks = expected // block_m
    seen = []
    for b in range(blocks):
        e = int(expert_ids[b])
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        real = rows[rows != sentinel]
        assert real.numel() > 0  # no block of padding only
        assert bool((flat[real.long()] == e).all())
        seen.extend(real.tolist())
    # Every routed row exactly once; nothing past the padded count.
    assert sorted(seen) == torch.nonzero(flat >= 0).flatten().tolist()
    assert bool((sorted_ids[expected:] == sentinel).all())
    assert bool((expert_ids[blocks:] == -1).all())


def test_quantize_groups_round_trip() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 512, generator=gen) * torch.logspace(-3, 2, 6).unsqueeze(1)
    codes, scale = bench.quantize_groups(x.to(torch.bfloat16))
    assert codes.dtype == bench.FP8 and scale.shape == (6, 4)
    groups = x.to(torch.bfloat16).float().view(6, 4, 128)
    torch.testing.assert_close(scale, groups.abs().amax(dim=-1) / bench.FP8_MAX)
    # The largest magnitude of each group maps to +-448 exactly.
    assert float(codes.float().abs().view(6, 4, 128).amax()) == bench.FP8_MAX
    back = codes.float().view(6, 4, 128) * scale.unsqueeze(-1)
    rel = (back - groups).norm() / groups.norm()
    assert rel < 3e-2


def test_quantize_activation_static() -> None:
    x = torch.tensor([[1.0, -2.0, 900.0, 0.5]])
    scale = torch.tensor([2.0])
    codes, out_scale = bench.quantize_activation(x, scale)
    assert out_scale is scale
    # x / scale, saturated at the FP8 range.
    assert codes.float().tolist() == [[0.5, -1.0, 448.0, 0.25]]


def test_quantize_groups_zero_group() -> None:
    """An all-zero group gets scale 1 (as the op's reference defines it)."""
    x = torch.zeros(2, 256)
    x[1, 128:] = 3.0
    codes, scale = bench.quantize_groups(x)
    expected = torch.tensor([[1.0, 1.0], [1.0, 3.0 / bench.FP8_MAX]])
    assert torch.equal(scale, expected)
    assert codes.float()[0].abs().sum() == 0
    torch.testing.assert_close(bench.group_round_trip(x), x)


# ---------------------------------------------------------------------------
# Floors
# ---------------------------------------------------------------------------


def test_moe_flops_small_case() -> None:
    """3 routes, H = 4, I = 2: per route a 4x4 gate-up (16 multiply-adds)
    and a 4x2 down (8), 2 FLOPs each: 3 * 48."""
    assert bench.moe_flops(3, hidden=4, inter=2) == 144
    assert bench.moe_flops(0, hidden=4, inter=2) == 0


def test_moe_flops_w3_tp1_t4096() -> None:
    """tp1 at 4096 tokens: 32768 routes of 2 * 4096 * (3072 + 1536)
    FLOPs, about 1.24 TFLOP."""
    flops = bench.moe_flops(4096 * 8, bench.HIDDEN, bench.FULL_INTERMEDIATE)
    assert flops == 2 * 32768 * 4096 * 4608
    assert round(flops / 1e12, 2) == 1.24


def test_local_routes_count_only_this_ranks_experts() -> None:
    case = bench.Case("ep8", block_wise=False, tokens=64, skewed=False)
    problem = bench.make_problem(case)
    ids = problem.topk_ids.long()
    local = int(((ids >= 0) & (ids < case.local_experts)).sum())
    assert 0 < problem.local_routes() == local < 64 * bench.TOPK
    tp = bench.make_problem(bench.Case("tp8", False, 64, False))
    assert tp.local_routes() == 64 * bench.TOPK


@pytest.mark.parametrize("tp", ["tp8", "ep8", "tp1"])
@pytest.mark.parametrize("block_wise", [False, True])
def test_floor_is_the_larger_of_bytes_and_flops(tp: str, block_wise: bool) -> None:
    case = bench.Case(tp, block_wise, tokens=512, skewed=False)
    problem = bench.make_problem(case)
    inter = case.intermediate()
    flops = bench.moe_flops(problem.local_routes(), bench.HIDDEN, inter)
    touched = len(problem.touched) * bench.expert_bytes(inter, block_wise)
    activations = 2 * 512 * bench.HIDDEN * 2 + problem.routing_bytes()
    bandwidth = 4000.0
    byte_us = (touched + activations) / (bandwidth * 1e3)
    # A fast matmul leaves the bytes as the floor, a slow one the FLOPs.
    for tflops in (1e6, 1.0):
        floor = bench.case_floor(case, problem, bandwidth, tflops)
        assert math.isclose(floor.byte_us, byte_us, rel_tol=1e-12)
        assert math.isclose(floor.flop_us, flops / (tflops * 1e6), rel_tol=1e-12)
        assert floor.us == max(floor.byte_us, floor.flop_us)
    assert bench.case_floor(case, problem, bandwidth, 1e6).us == byte_us
    slow = bench.case_floor(case, problem, bandwidth, 1.0)
    assert slow.us == slow.flop_us > byte_us


def test_record_carries_both_floors() -> None:
    case = bench.Case("tp1", False, tokens=4096, skewed=False)
    floor = bench.Floor(byte_us=864.0, flop_us=891.3)
    record = bench._record(case, bench.HPC, 1000.0, floor)
    assert record["floor_us"] == 891.3
    assert record["byte_floor_us"] == 864.0
    assert record["flop_floor_us"] == 891.3
    assert record["fraction_of_floor"] == 0.891
    failed = bench._record(case, bench.HPC, None, None, error="x")
    assert failed["floor_us"] is None and "byte_floor_us" not in failed


def test_fp8_rate_falls_back_to_twice_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    def measured(n: int, iters: int) -> tuple[dict, dict]:
        return {"bf16": 700.0, "fp8": None}, {"bf16": "mm", "fp8": "not measured"}

    monkeypatch.setattr(bench_utils, "measure_matmul_tflops", measured)
    used, rates, notes = bench_utils.floor_matmul_tflops()
    assert used == {"bf16": 700.0, "fp8": 1400.0}
    assert rates["fp8"] is None
    assert notes["fp8"].endswith("fp8 floors use twice the bf16 rate")


# ---------------------------------------------------------------------------
# The fused_experts baseline
# ---------------------------------------------------------------------------


def test_fused_experts_is_a_baseline_argument() -> None:
    args = bench.parse_args(["--baselines", "fused_experts,triton_gemms"])
    assert args.baselines.split(",") == [bench.FUSED_EXPERTS, bench.TRITON_GEMMS]
    assert bench.FUSED_EXPERTS in bench.parse_args([]).baselines.split(",")
    with pytest.raises(SystemExit):
        bench.parse_args(["--baselines", "fused_moe"])


def test_missing_ops() -> None:
    assert bench_utils.missing_ops(["aten.mm", "_hpc_absent_ns.op"]) == [
        "_hpc_absent_ns.op"
    ]
    assert bench_utils.missing_ops(["aten.no_such_op_here"]) == ["aten.no_such_op_here"]


def test_fused_experts_skipped_without_moe_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Python of vLLM imports but its compiled MoE ops are not loaded:
    fused_experts is skipped, naming the absent ops; triton_gemms (Triton
    only) is not."""
    monkeypatch.setattr(bench, "missing_baselines", lambda sources, wanted: {})
    monkeypatch.setattr(
        bench,
        "missing_ops",
        lambda ops: [op for op in ops if op.startswith("_moe_C.")],
    )
    missing = bench.find_missing(bench.BASELINES)
    assert set(missing) == {bench.FUSED_EXPERTS}
    reason = missing[bench.FUSED_EXPERTS]
    assert "torch.ops._moe_C.moe_align_block_size" in reason
    assert "torch.ops._moe_C.moe_sum" in reason
    # Not asked for: not checked.
    assert bench.find_missing((bench.TORCH, bench.TRITON_GEMMS)) == {}


def test_fused_experts_ops_are_what_it_calls() -> None:
    """Each op the skip checks is one vLLM 0.33's fused_experts path calls
    (where vLLM's Python is installed)."""
    fused_moe = pytest.importorskip(bench.FUSED_MOE_MODULE)
    from vllm import _custom_ops
    from vllm.model_executor.layers.fused_moe import activation, utils
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    source = "".join(
        inspect.getsource(m)
        for m in (fused_moe, _custom_ops, activation, utils, fp8_utils)
    )
    for op in bench.FUSED_EXPERTS_OPS:
        assert f"torch.ops.{op}(" in source, op


def test_fused_experts_reason_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "FUSED_MOE_MODULE", "vllm_absent_for_this_test")
    missing = bench.find_missing((bench.FUSED_EXPERTS,))
    assert missing[bench.FUSED_EXPERTS].startswith("not importable: ")


# ---------------------------------------------------------------------------
# Case names
# ---------------------------------------------------------------------------


def test_case_names_unchanged() -> None:
    """W3 names as the design notes fix them, every combination once."""
    names = [c.name for c in bench.all_cases()]
    pattern = re.compile(r"(tp8|ep8|tp1)-(pertensor|blockwise)-t(\d+)(-skewed)?")
    assert all(pattern.fullmatch(n) for n in names)
    tokens = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
    expected = {
        f"{tp}-{q}-t{t}{s}"
        for tp in ("tp8", "ep8", "tp1")
        for q in ("pertensor", "blockwise")
        for t in tokens
        for s in ("", "-skewed")
    }
    assert len(names) == len(expected) and set(names) == expected
    assert set(bench.QUICK_CASES) <= expected
