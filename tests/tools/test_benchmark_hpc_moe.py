# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of the MoE benchmark's ``triton_gemms`` input preparation: the
routing alignment it hands vLLM's Triton kernel and the 1x128 activation
quantization."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "kernels"))
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
