# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of the benchmarks' shared result merging (a run split over
several calls keeps one results file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))

import bench_utils  # noqa: E402


def _rec(workload: str, case: str, impl: str, us: float, ratios=None):
    return {
        "workload": workload,
        "case": case,
        "impl": impl,
        "us": us,
        "ratios": ratios or {},
    }


def test_merge_keeps_unmeasured_records_and_ratios(tmp_path: Path):
    old = {
        "commit": "abc",
        "date": "2026-11-29",
        "copy_bandwidth_gbps": 4200.0,
        "fp8_matmul_tflops": 1600.0,
        "records": [
            _rec("W1", "tp1-bf16", "hpc", 300.0, {"static": 1.4, "fa3": 0.8}),
            _rec("W1", "tp1-bf16", "static", 420.0),
            _rec("W2", "tp8-bf16-b1x1024-q1", "hpc", 20.0),
        ],
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    new = [
        _rec("W1", "tp1-bf16", "hpc", 274.0, {"fa3": 0.91}),
        _rec("W1", "tp1-bf16", "fa3", 249.0),
        _rec("W1", "tp8-bf16", "hpc", 59.0),
    ]
    order = [("W1", "tp1-bf16"), ("W1", "tp8-bf16"), ("W2", "tp8-bf16-b1x1024-q1")]
    merged, info = bench_utils.merge_records(
        path, new, order, carried=("fp8_matmul_tflops",)
    )
    keys = [(r["workload"], r["case"], r["impl"]) for r in merged]
    # The re-measured hpc record is this run's; the old static and W2 stay.
    assert keys.count(("W1", "tp1-bf16", "hpc")) == 1
    assert ("W1", "tp1-bf16", "static") in keys
    assert ("W2", "tp8-bf16-b1x1024-q1", "hpc") in keys
    hpc = next(r for r in merged if r["case"] == "tp1-bf16" and r["impl"] == "hpc")
    assert hpc["us"] == 274.0
    # This run's fa3 ratio wins; the static ratio comes from the old run.
    assert hpc["ratios"] == {"fa3": 0.91, "static": 1.4}
    # Case order: both W1 cases before W2.
    assert [r["workload"] for r in merged][-1] == "W2"
    assert info == {
        "records": 2,
        "commit": "abc",
        "date": "2026-11-29",
        "copy_bandwidth_gbps": 4200.0,
        "fp8_matmul_tflops": 1600.0,
    }


def test_run_guarded_raises_device_lost_after_recording(monkeypatch):
    """A case whose failure leaves the device unusable is recorded, then
    ends the run (so the finished cases can still be written)."""

    def fail():
        raise RuntimeError("CUDA error: unspecified launch failure")

    def sticky():
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(bench_utils.torch.accelerator, "empty_cache", sticky)
    records: list = []
    try:
        bench_utils.run_guarded(
            "W2",
            "case-a",
            fail,
            lambda error: {"case": "case-a", "us": None, "error": error},
            records,
            0.0,
        )
    except bench_utils.DeviceLost as err:
        assert "unspecified launch failure" in str(err)
    else:
        raise AssertionError("run_guarded did not raise DeviceLost")
    assert [r["case"] for r in records] == ["case-a"]
    assert "unspecified launch failure" in records[0]["error"]


def test_run_guarded_goes_on_after_a_recoverable_failure(monkeypatch):
    monkeypatch.setattr(bench_utils.torch.accelerator, "empty_cache", lambda: None)
    records: list = []

    def fail():
        raise RuntimeError("out of memory")

    ok = bench_utils.run_guarded(
        "W2",
        "case-b",
        fail,
        lambda error: {"case": "case-b", "us": None, "error": error},
        records,
        0.0,
    )
    assert ok is False
    assert records == [
        {"case": "case-b", "us": None, "error": "RuntimeError: out of memory"}
    ]
