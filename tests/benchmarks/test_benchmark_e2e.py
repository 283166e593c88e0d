# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of the E2E benchmark's driver: model configs, the agreement
measure and the records it writes (the runs themselves need an H200)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import benchmark_e2e as e2e  # noqa: E402


def _run(backend: str, decode: float, prefill: float, tokens, logprobs, kv="bf16"):
    return {
        "model": "hy3",
        "kv": kv,
        "backend": backend,
        "init_s": 50.0,
        "decode_step_us": decode,
        "prefill_us": prefill,
        "agreement": [{"tokens": tokens, "logprobs": logprobs}],
    }


@pytest.mark.parametrize("model", sorted(e2e.MODELS))
@pytest.mark.parametrize("layers", [2, 4])
def test_model_config_shapes(model: str, layers: int):
    config = e2e._model_config(model, layers)
    assert config["num_hidden_layers"] == layers
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    group = config["num_attention_heads"] // config["num_key_value_heads"]
    assert group == {"llama": 4, "qwen3": 5, "hy3": 8}[model]
    assert config["head_dim"] == 128
    if model == "hy3":
        quant = config["quantization_config"]
        assert quant["weight_block_size"] == [128, 128]
        # Every attention projection of every layer stays unquantized.
        assert len(quant["ignored_layers"]) == 4 * layers
        assert f"model.layers.{layers - 1}.self_attn.o_proj" in quant["ignored_layers"]
        assert config["mlp_layer_types"] == ["sparse"] * layers
    # The shared table is not modified by building a config.
    assert "ignored_layers" not in e2e.MODELS["hy3"]["quantization_config"]


def test_agreement_stops_at_the_first_diverging_step():
    hpc = _run(
        "HPC_ATTN", 1, 1, [5, 7, 9], [{"5": -1.0, "6": -2.0}, {"7": -0.5}, {"9": -3.0}]
    )
    ref = _run(
        "TRITON_ATTN",
        1,
        1,
        [5, 8, 9],
        [{"5": -1.25, "6": -2.0}, {"7": -0.5}, {"9": 0.0}],
    )
    got = e2e._agreement(hpc, ref)
    assert got["same_first_token"] == "1/1"
    assert got["same_tokens"] == "0/1"
    # Steps 0 and 1 share their prefixes; step 2 follows different tokens.
    assert got["logprobs_compared"] == 3
    assert got["max_abs_logprob_diff"] == 0.25


def test_records_ratios_and_missing_runs():
    logprobs = [{"5": -1.0}]
    runs = [
        _run("HPC_ATTN", 100.0, 400.0, [5], logprobs),
        _run("TRITON_ATTN", 150.0, 1200.0, [5], logprobs),
        {"model": "hy3", "kv": "bf16", "backend": "FLASH_ATTN", "error": "exit 1"},
    ]
    runs[0]["prologue_calls_per_step"] = 2.0
    # A profiled HPC_ATTN step: its decode kernels count, its planner does not.
    runs[0]["decode_kernels"] = [
        {"kernel": "void hpc::decode::decode_kernel<128>(...)", "us_per_step": 30.0},
        {"kernel": "void hpc::decode::plan_decode_kernel(...)", "us_per_step": 4.0},
        {"kernel": "void hpc::moe::moe_gemm_kernel<true>(...)", "us_per_step": 50.0},
    ]
    records = {(r["case"], r["impl"]): r for r in e2e._records(runs, layers=2)}
    assert set(records) == {
        ("hy3-bf16-decode", "hpc"),
        ("hy3-bf16-decode", "triton_attn"),
        ("hy3-bf16-prefill", "hpc"),
        ("hy3-bf16-prefill", "triton_attn"),
    }
    assert records[("hy3-bf16-decode", "hpc")]["ratios"] == {"triton_attn": 1.5}
    assert records[("hy3-bf16-prefill", "hpc")]["ratios"] == {"triton_attn": 3.0}
    assert records[("hy3-bf16-decode", "triton_attn")]["ratios"] == {}
    assert records[("hy3-bf16-decode", "hpc")]["attn_kernel_us_per_layer"] == 15.0
    assert "attn_kernel_us_per_layer" not in records[("hy3-bf16-decode", "triton_attn")]
    assert "attn_kernel_us_per_layer" not in records[("hy3-bf16-prefill", "hpc")]
    agreement = records[("hy3-bf16-decode", "hpc")]["agreement_triton_attn"]
    assert agreement["same_tokens"] == "1/1"
    # The failed FLASH_ATTN run gives no agreement record.
    assert "agreement_flash_attn" not in records[("hy3-bf16-decode", "hpc")]
    assert records[("hy3-bf16-decode", "hpc")]["fused_prologue_calls_per_layer"] == 1.0
    assert "fused_prologue_calls_per_layer" not in records[("hy3-bf16-prefill", "hpc")]
    assert all(r["workload"] == "E2E" for r in records.values())


def test_moe_backend_records_stand_apart():
    logprobs = [{"5": -1.0}]
    runs = [
        _run("FLASH_ATTN", 100.0, 400.0, [5], logprobs) | {"moe": "hpc"},
        _run("FLASH_ATTN", 110.0, 500.0, [5], logprobs) | {"moe": "vllm"},
        _run("HPC_ATTN", 90.0, 380.0, [5], logprobs) | {"moe": "hpc"},
        # Only one MoE backend ran on this KV dtype: no comparison.
        _run("FLASH_ATTN", 100.0, 400.0, [5], logprobs, kv="fp8") | {"moe": "vllm"},
    ]
    records = e2e._records(runs, layers=2)
    moe = {(r["case"], r["impl"]): r for r in records if r["workload"] == "E2E_MOE"}
    assert set(moe) == {
        ("hy3-bf16-flash_attn-decode", "hpc"),
        ("hy3-bf16-flash_attn-decode", "vllm_moe"),
        ("hy3-bf16-flash_attn-prefill", "hpc"),
        ("hy3-bf16-flash_attn-prefill", "vllm_moe"),
    }
    assert moe[("hy3-bf16-flash_attn-prefill", "hpc")]["ratios"] == {"vllm_moe": 1.25}
    assert moe[("hy3-bf16-flash_attn-decode", "hpc")]["ratios"] == {"vllm_moe": 1.1}
    # Unprofiled runs: no device times.
    assert not any("device_us" in r or "device_ratios" in r for r in moe.values())
    # The attention tables keep the --moe-backend hpc runs only.
    e2e_records = {(r["case"], r["impl"]) for r in records if r["workload"] == "E2E"}
    assert e2e_records == {
        ("hy3-bf16-decode", "hpc"),
        ("hy3-bf16-decode", "flash_attn"),
        ("hy3-bf16-prefill", "hpc"),
        ("hy3-bf16-prefill", "flash_attn"),
    }
    assert e2e.run_name(runs[1]) == "hy3-bf16-FLASH_ATTN-moe-vllm"
    assert e2e.run_name(runs[0]) == "hy3-bf16-FLASH_ATTN"


def test_moe_backend_records_carry_profiled_device_time():
    logprobs = [{"5": -1.0}]
    device = {"decode_device_us_per_step": 80.0, "prefill_device_us": 300.0}
    runs = [
        _run("FLASH_ATTN", 100.0, 400.0, [5], logprobs) | {"moe": "hpc"} | device,
        _run("FLASH_ATTN", 110.0, 500.0, [5], logprobs)
        | {"moe": "vllm", "decode_device_us_per_step": 100.0},
    ]
    moe = {
        (r["case"], r["impl"]): r
        for r in e2e._records(runs, layers=2)
        if r["workload"] == "E2E_MOE"
    }
    hpc_prefill = moe[("hy3-bf16-flash_attn-prefill", "hpc")]
    assert hpc_prefill["device_us"] == 300.0
    # vLLM's run has no profiled prefill: no device ratio for it.
    assert "device_ratios" not in hpc_prefill
    assert "device_us" not in moe[("hy3-bf16-flash_attn-prefill", "vllm_moe")]
    hpc_decode = moe[("hy3-bf16-flash_attn-decode", "hpc")]
    assert hpc_decode["device_ratios"] == {"vllm_moe": 1.25}
    assert moe[("hy3-bf16-flash_attn-decode", "vllm_moe")]["device_us"] == 100.0


def test_attention_records_carry_profiled_device_time():
    logprobs = [{"5": -1.0}]
    runs = [
        _run("HPC_ATTN", 100.0, 400.0, [5], logprobs)
        | {"decode_device_us_per_step": 60.0, "prefill_device_us": 300.0},
        _run("FLASH_ATTN", 90.0, 500.0, [5], logprobs)
        | {"decode_device_us_per_step": 75.0},
    ]
    records = {(r["case"], r["impl"]): r for r in e2e._records(runs, layers=2)}
    hpc_decode = records[("hy3-bf16-decode", "hpc")]
    # Slower by the wall clock, faster on the device.
    assert hpc_decode["ratios"] == {"flash_attn": 0.9}
    assert hpc_decode["device_us"] == 60.0
    assert hpc_decode["device_ratios"] == {"flash_attn": 1.25}
    assert records[("hy3-bf16-decode", "flash_attn")]["device_us"] == 75.0
    assert "device_ratios" not in records[("hy3-bf16-decode", "flash_attn")]
    # FLASH_ATTN's prefill was not profiled: no device ratio.
    assert records[("hy3-bf16-prefill", "hpc")]["device_us"] == 300.0
    assert "device_ratios" not in records[("hy3-bf16-prefill", "hpc")]


def test_fusion_passes_are_vllm_flags():
    """The passes the benchmark turns on for HPC_ATTN are PassConfig flags
    of the vLLM it runs with, and each model without HpcRopeNorm has one."""
    from vllm.config.compilation import PassConfig

    assert set(e2e.FUSION_PASS) == {"llama", "qwen3"}
    for flag in e2e.FUSION_PASS.values():
        assert flag in PassConfig.__dataclass_fields__


class _FakeEngine:
    def __init__(self, steps: int) -> None:
        self.left = steps
        self.stepped = 0

    def has_unfinished_requests(self) -> bool:
        return self.left > 0

    def step(self) -> None:
        self.left -= 1
        self.stepped += 1


class _FakeProfiler:
    """Stands in for torch.profiler.profile (CUDA activity needs a GPU)."""

    def __init__(self, **kwargs) -> None:
        self.running = False

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text('{"traceEvents": []}')

    def key_averages(self):
        from torch.autograd import DeviceType

        cuda, cpu = DeviceType.CUDA, DeviceType.CPU
        rope = "void hpc::rope_norm::rope_norm_kernel<bf16, 128>(...)"
        # (key, device type, self device us, self CPU us, count). aten::mm
        # launched "gemm": the profiler gives the host operator its kernels'
        # device time too, which must not count twice.
        rows = [
            ("decode_kernel", cuda, 300.0, 0.0, 4),
            ("gemm", cuda, 900.0, 0.0, 8),
            ("aten::mm", cpu, 900.0, 30.0, 8),
            (rope, cuda, 8.0, 0.0, 4),
            ("host_only", cpu, 0.0, 50.0, 2),
            ("idle", cpu, 0.0, 0.0, 1),
        ]
        return [
            types.SimpleNamespace(
                key=key,
                device_type=device_type,
                self_device_time_total=device_us,
                self_cpu_time_total=cpu_us,
                count=count,
            )
            for key, device_type, device_us, cpu_us, count in rows
        ]


def test_profiled_steps_trace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    import gzip
    import json

    import torch

    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfiler)
    trace = tmp_path / "hy3-bf16-HPC_ATTN.trace.json.gz"
    times, kernels = e2e._step_until_done(_FakeEngine(6), range(2, 4), trace)
    assert len(times) == 4 and kernels is not None
    # Gzipped JSON, and the profiler's plain file is not left beside it.
    assert json.loads(gzip.decompress(trace.read_bytes())) == {"traceEvents": []}
    assert [f.name for f in tmp_path.iterdir()] == [trace.name]


def test_profiled_steps_are_not_timed(monkeypatch: pytest.MonkeyPatch):
    import torch

    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfiler)
    engine = _FakeEngine(6)
    times, kernels = e2e._step_until_done(engine)
    assert engine.stepped == 6 and len(times) == 6 and kernels is None

    engine = _FakeEngine(6)
    times, kernels = e2e._step_until_done(engine, range(2, 4))
    assert engine.stepped == 6
    assert len(times) == 4  # steps 2 and 3 ran under the profiler
    # Per step over the two profiled steps, costliest first: device work,
    # its total, and host operators by their own CPU time.
    assert kernels == {
        "kernels": [
            {"kernel": "gemm", "us_per_step": 450.0, "calls_per_step": 4.0},
            {"kernel": "decode_kernel", "us_per_step": 150.0, "calls_per_step": 2.0},
            {
                "kernel": "void hpc::rope_norm::rope_norm_kernel<bf16, 128>(...)",
                "us_per_step": 4.0,
                "calls_per_step": 2.0,
            },
        ],
        "device_us_per_step": 604.0,
        "host_ops": [
            {"op": "host_only", "cpu_us_per_step": 25.0, "calls_per_step": 1.0},
            {"op": "aten::mm", "cpu_us_per_step": 15.0, "calls_per_step": 4.0},
        ],
        "prologue_calls_per_step": 2.0,
    }
