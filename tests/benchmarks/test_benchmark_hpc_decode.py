# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of the decode benchmark's driver: the W1B cases, the options,
the FA3 baselines (skipped without FlashAttention-3, and called as vLLM's
FLASH_ATTN backend calls it, through a stand-in module), the chained
layers and the routing of each implementation to its reference (the runs
themselves need an H200)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "kernels"))
import benchmark_hpc_decode as bench  # noqa: E402

FA3_MODULE = "vllm.vllm_flash_attn"


class Fa3Module(types.ModuleType):
    """A stand-in for ``vllm.vllm_flash_attn`` with what the benchmark uses."""

    flash_attn_varlen_func: Callable[..., Any]
    fa_version_unsupported_reason: Callable[[int], str | None]
    get_scheduler_metadata: Callable[..., torch.Tensor]


def test_w1b_cases_are_w1_cases_by_name():
    w1, w1b = bench.w1_cases(), bench.w1b_cases()
    assert [c.name for c in w1b] == [c.name for c in w1]
    assert [c.name for c in w1b] == ["tp1-bf16", "tp1-fp8", "tp8-bf16", "tp8-fp8"]
    assert {c.workload for c in w1b} == {"W1B"}
    for a, b in zip(w1, w1b, strict=True):
        assert (a.lengths, a.tp, a.fp8, a.query_tokens) == (
            b.lengths,
            b.tp,
            b.fp8,
            b.query_tokens,
        )
        assert a.floor_bytes() == b.floor_bytes()


def test_all_cases_select_workloads():
    only = bench.all_cases(quick=False, fp8_all=False, workloads={"W1B"})
    assert [c.workload for c in only] == ["W1B"] * 4
    both = bench.all_cases(quick=True, fp8_all=False, workloads={"W1", "W1B"})
    assert [c.workload for c in both] == ["W1"] * 4 + ["W1B"] * 4
    assert "W1B" in bench.WORKLOADS


def test_w1_floor_bytes():
    tp8_bf16 = next(c for c in bench.w1_cases() if c.name == "tp8-bf16")
    # (131072 + 31 * 4096) tokens x 1 KV head x 128 x (K and V) x 2 bytes.
    assert tp8_bf16.floor_bytes() == 258048 * 128 * 2 * 2 == 132_120_576
    # W1's lengths are whole blocks: the cache holds exactly the floor bytes.
    for case in bench.w1_cases():
        assert case.kv_bytes() == case.floor_bytes()


def test_set_bytes_count_the_e4m3_queries():
    bf16 = bench.Case("W2", "tp1", False, (4096,) * 8, 2)
    fp8 = bench.Case("W2", "tp1", True, (4096,) * 8, 2)
    rows = 8 * 2 * 64 * 128
    assert bf16.set_bytes() - bf16.kv_bytes() == 2 * rows * 2
    assert fp8.set_bytes() - fp8.kv_bytes() == 2 * rows * 2 + rows


def test_parse_args_w1b_and_fa3_baselines():
    args = bench.parse_args(["--workloads", "W1B", "--baselines", "fa3,fa3_capped"])
    assert args.workloads == "W1B"
    assert args.baselines.split(",") == [bench.FA3, bench.FA3_CAPPED]
    default = bench.parse_args([])
    assert {"fa3", "fa3_capped"} <= set(default.baselines.split(","))
    assert "W1B" in default.workloads.split(",")
    with pytest.raises(SystemExit):
        bench.parse_args(["--baselines", "fa4"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--workloads", "W1C"])


def test_fa3_split_choices():
    # FA3's heuristic, and vLLM's cap under full CUDA graphs.
    assert bench.FA3_SPLITS == {"fa3": 0, "fa3_capped": 32}
    assert set(bench.STEP_WORK) == {bench.HPC, *bench.BASELINES}


def test_fa3_skipped_with_reason_without_vllm_flash_attn(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setitem(sys.modules, FA3_MODULE, None)
    missing = bench.find_missing(("static", "fa3", "fa3_capped"))
    assert {"fa3", "fa3_capped"} <= set(missing)
    assert "static" not in missing
    assert all(FA3_MODULE in missing[n] for n in ("fa3", "fa3_capped"))
    out = capsys.readouterr().out
    assert f"fa3 skipped: {missing['fa3']}" in out
    assert "fa3_capped skipped: " in out
    # Not asked for: not looked up, not listed.
    assert not {"fa3", "fa3_capped"} & set(bench.find_missing(("static",)))


def test_fa3_not_missing_when_supported(monkeypatch: pytest.MonkeyPatch):
    fake = Fa3Module(FA3_MODULE)
    fake.flash_attn_varlen_func = lambda **kw: None
    fake.fa_version_unsupported_reason = lambda version: None
    monkeypatch.setitem(sys.modules, FA3_MODULE, fake)
    assert not {"fa3", "fa3_capped"} & set(bench.find_missing(("fa3", "fa3_capped")))
    fake.fa_version_unsupported_reason = lambda version: "needs sm90"
    missing = bench.find_missing(("fa3_capped",))
    assert missing == {"fa3_capped": "needs sm90"}


class FakeFa3:
    """Stands in for ``vllm.vllm_flash_attn``, recording its calls."""

    def __init__(self, fail_metadata: bool = False) -> None:
        self.metadata_calls: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.metadata = torch.zeros(17, dtype=torch.int32)
        self.fail_metadata = fail_metadata

    def module(self) -> types.ModuleType:
        mod = Fa3Module(FA3_MODULE)
        mod.get_scheduler_metadata = self.get_scheduler_metadata
        mod.flash_attn_varlen_func = self.flash_attn_varlen_func
        return mod

    def get_scheduler_metadata(self, **kwargs: Any) -> torch.Tensor:
        self.metadata_calls.append(kwargs)
        if self.fail_metadata:
            raise RuntimeError("no metadata here")
        return self.metadata

    def flash_attn_varlen_func(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)


@pytest.mark.parametrize("name", ["fa3", "fa3_capped"])
def test_fa3_called_as_vllm_does_fp8(monkeypatch: pytest.MonkeyPatch, name: str):
    fake = FakeFa3()
    monkeypatch.setitem(sys.modules, FA3_MODULE, fake.module())
    case = bench.Case("W2", "tp1", True, (192, 64), 2)
    layout = bench.make_layout(case, device="cpu")
    s = bench.make_input_set(case, seed=0, device="cpu")
    notes: dict[str, str] = {}
    splits = bench.FA3_SPLITS[name]
    run = bench.make_fa3(case, layout, splits, notes, name)
    run(s)
    run(s)
    # The step's scheduler metadata once, at setup, as vLLM's builder does.
    assert len(fake.metadata_calls) == 1
    meta = fake.metadata_calls[0]
    assert meta["batch_size"] == 2 and meta["max_seqlen_q"] == 2
    assert meta["max_seqlen_k"] == 192
    assert (meta["num_heads_q"], meta["num_heads_kv"], meta["headdim"]) == (64, 8, 128)
    assert meta["page_size"] == 64 and meta["causal"] is True
    assert meta["qkv_dtype"] == bench.FP8
    assert meta["num_splits"] == splits
    assert meta["cache_seqlens"] is layout.kv_lens
    assert len(fake.calls) == 2
    call = fake.calls[0]
    assert call["num_splits"] == splits and call["fa_version"] == 3
    assert call["scheduler_metadata"] is fake.metadata
    assert call["causal"] is True and call["max_seqlen_q"] == 2
    assert call["cu_seqlens_q"].tolist() == [0, 2, 4]
    assert call["seqused_k"] is layout.kv_lens
    assert call["block_table"] is layout.block_table
    assert call["out"] is s.out
    # E4M3 queries for an E4M3 cache (FA3 wants one dtype), same values.
    assert call["q"] is s.q_fp8 and s.q_fp8.dtype == bench.FP8
    torch.testing.assert_close(s.q_fp8.float(), s.q.float(), rtol=1 / 16, atol=2**-9)
    for key, value in (("q_descale", 1.0), ("k_descale", 0.5), ("v_descale", 0.75)):
        assert call[key].shape == (2, 8)
        assert bool((call[key] == value).all())
    # The cache in place: K and V are views of the packed tensor.
    k, v = call["k"], call["v"]
    assert k.shape == v.shape == (case.num_blocks, 64, 8, 128)
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k.data_ptr() == s.kv.data_ptr()
    assert v.data_ptr() == s.kv.data_ptr() + 128 * s.kv.element_size()
    assert k.stride(0) == 8 * 64 * 256 and k.stride(1) == 256
    assert f"num_splits={splits}" in notes[name]
    assert "E4M3 queries" in notes[name]


def test_fa3_bf16_canonical_strides_and_no_descales(monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("vllm.utils.torch_utils")
    fake = FakeFa3()
    monkeypatch.setitem(sys.modules, FA3_MODULE, fake.module())
    case = bench.Case("W1", "tp8", False, (128, 64), 1)
    layout = bench.make_layout(case, device="cpu")
    s = bench.make_input_set(case, seed=0, device="cpu")
    bench.make_fa3(case, layout, 0, {}, "fa3")(s)
    call = fake.calls[0]
    assert call["q"] is s.q and s.q_fp8 is None
    assert "q_descale" not in call and "k_descale" not in call
    # One KV head: its stride is made canonical (D), as vLLM's backend does
    # for TMA; the token and page strides stay the cache's.
    k = call["k"]
    assert k.shape == (3, 64, 1, 128)
    assert s.key_cache.stride(2) == 64 * 256
    assert k.stride() == (64 * 256, 256, 128, 1)


def test_fa3_without_metadata_is_noted(monkeypatch: pytest.MonkeyPatch):
    fake = FakeFa3(fail_metadata=True)
    monkeypatch.setitem(sys.modules, FA3_MODULE, fake.module())
    case = bench.Case("W1", "tp8", False, (64,), 1)
    layout = bench.make_layout(case, device="cpu")
    notes: dict[str, str] = {}
    bench.make_fa3(case, layout, 32, notes, "fa3_capped")(
        bench.make_input_set(case, seed=0, device="cpu")
    )
    assert fake.calls[0]["scheduler_metadata"] is None
    assert "no scheduler metadata" in notes["fa3_capped"]
    assert "no metadata here" in notes["fa3_capped"]


class Layer:
    def __init__(self, log: list[Any], with_plan: bool) -> None:
        self.log = log
        if with_plan:
            self.plan = lambda: log.append("plan")

    def __call__(self, s: int) -> int:
        self.log.append(s)
        return 10 * s


def test_chain_layers_plans_once_then_runs_every_layer():
    log: list[Any] = []
    impl = Layer(log, with_plan=True)
    assert bench.chain_layers(impl)([0, 1, 2]) == [0, 10, 20]
    assert log == ["plan", 0, 1, 2]
    log.clear()
    assert bench.chain_layers(impl, plan=False)([3, 4]) == [30, 40]
    assert log == [3, 4]
    log.clear()
    bench.chain_layers(Layer(log, with_plan=False))([5])
    assert log == [5]


def _options(max_kv_bytes: int) -> bench.Options:
    return bench.Options(iters=50, warmup=1, baselines=(), max_kv_bytes=max_kv_bytes)


def test_choose_num_graphs():
    for case in bench.w1b_cases():
        # 8 layers already rotate more than 4 sets: one graph.
        assert bench.choose_num_graphs(case, _options(10**12)) == 1
        layers = bench.W1B_LAYERS * case.set_bytes()
        assert bench.choose_num_graphs(case, _options(layers)) == 1
        assert bench.choose_num_graphs(case, _options(layers - 1)) == 0
    small = bench.Case("W1B", "tp8", False, (64,), 1)
    # 64 sets wanted of a tiny case: 8 graphs of 8 layers.
    assert bench.choose_num_graphs(small, _options(10**12)) == 8


def test_takes_fp8_query():
    fp8 = bench.Case("W1", "tp8", True, (64,), 1)
    bf16 = bench.Case("W1", "tp8", False, (64,), 1)
    assert bench.takes_fp8_query(fp8, "fa3") and bench.takes_fp8_query(
        fp8, "fa3_capped"
    )
    assert not bench.takes_fp8_query(fp8, "hpc")
    assert not bench.takes_fp8_query(fp8, "triton_unified")
    assert not bench.takes_fp8_query(bf16, "fa3")


def _exact(refs: dict[int, torch.Tensor], q_tokens: int):
    """An implementation whose output is exactly ``refs`` on their rows."""

    def run(s: Any) -> torch.Tensor:
        s.out.zero_()
        for b, rows in refs.items():
            s.out[b * q_tokens : (b + 1) * q_tokens] = rows.to(s.out.dtype)
        return s.out

    return run


def test_check_case_uses_the_e4m3_reference_for_fa3(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    case = bench.Case("W2", "tp8", True, (128, 64, 192), 1)
    layout = bench.make_layout(case, device="cpu")
    s = bench.make_input_set(case, seed=1, device="cpu")
    refs = bench.Refs(case, layout, [s])
    bf16_rows, e4m3_rows = refs.get(0, False), refs.get(0, True)
    assert set(bf16_rows) == set(bench.ref_seqs(case)) == {0, 2}
    # The two queries differ, so their references do.
    assert max((bf16_rows[b] - e4m3_rows[b]).abs().max() for b in bf16_rows) > 1e-3
    makers = {"hpc": lambda: _exact(bf16_rows, 1), "fa3": lambda: _exact(e4m3_rows, 1)}
    checked = bench.check_case(case, ["hpc", "fa3"], makers, s, refs)
    assert set(checked.impls) == {"hpc", "fa3"}
    # Each against the reference of the queries it reads: exact (up to the
    # bf16 output), where the other reference would be off by far more.
    assert checked.ref_err["hpc"] < 4e-3 and checked.ref_err["fa3"] < 4e-3
    assert refs.error(0, True, checked.outputs["hpc"]) > 2 * checked.ref_err["hpc"]


def test_check_replay_poisons_outputs(monkeypatch: pytest.MonkeyPatch):
    class Graph:
        def __init__(self, outs: list[torch.Tensor], fill: list[bool]) -> None:
            self.outs, self.fill = outs, fill

        def replay(self) -> None:
            for out, written in zip(self.outs, self.fill, strict=True):
                if written:
                    out.fill_(1.0)

    outs = [torch.zeros(2), torch.zeros(2)]
    seen: list[int] = []

    def error(i: int, out: torch.Tensor) -> float:
        seen.append(i)
        return 0.0 if bool(torch.isfinite(out).all()) else float("inf")

    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    errs = bench.check_replay(Graph(outs, [True, False]), outs, error)
    # The layer the replay left alone keeps its NaN and fails.
    assert errs == [0.0, float("inf")]
    assert seen == [0, 1]


# ---------------------------------------------------------------------------
# The W1 and W1B drivers end to end on the CPU, with stand-ins for the GPU:
# graphs that replay by calling, a clock that counts calls, an hpc kernel
# and a FlashAttention-3 module that compute attention exactly.
# ---------------------------------------------------------------------------


class Counter:
    calls = 0


class ExactHpc:
    """Stands in for the decode kernel: the float32 reference of the rows
    the benchmark checks, and a ``plan`` like the real one's."""

    def __init__(self, case: bench.Case, layout: bench.Layout, mode: str) -> None:
        self.case, self.layout, self.mode = case, layout, mode
        self.plans = 0

    def plan(self) -> None:
        self.plans += 1
        Counter.calls += 1

    def __call__(self, s: Any) -> torch.Tensor:
        Counter.calls += 1
        rows = bench.reference_rows(
            self.case, self.layout, s, list(range(self.case.batch))
        )
        q = self.case.query_tokens
        for b, r in rows.items():
            s.out[b * q : (b + 1) * q] = r.to(s.out.dtype)
        return s.out


def exact_fa3(**kw: Any) -> None:
    """FlashAttention-3's decode call, computed directly from its
    arguments (descales multiply Q, K and V)."""
    Counter.calls += 1
    q, k, v, out = kw["q"], kw["k"], kw["v"], kw["out"]
    cu = kw["cu_seqlens_q"].tolist()
    one = torch.ones(1)
    qd = kw.get("q_descale", one).flatten()[0].item()
    kd = kw.get("k_descale", one).flatten()[0].item()
    vd = kw.get("v_descale", one).flatten()[0].item()
    for b, n in enumerate(kw["seqused_k"].tolist()):
        blocks = kw["block_table"][b, : -(-n // 64)].long()
        keys = bench.gather_tokens(k, blocks, n) * kd
        values = bench.gather_tokens(v, blocks, n) * vd
        rows = q[cu[b] : cu[b + 1]].float() * qd
        last = n - rows.shape[0] + torch.arange(rows.shape[0])
        o = bench.causal_attention_rows(rows, keys, values, last, kw["softmax_scale"])
        out[cu[b] : cu[b + 1]] = o.to(out.dtype)


class ReplayGraph:
    def __init__(self, impl: Any, s: Any) -> None:
        self.impl, self.s = impl, s

    def replay(self) -> None:
        self.impl(self.s)


def replay_graphs(impl: Any, sets: Any, pool: Any, outputs: Any = None) -> list:
    graphs = []
    for s in sets:
        out = impl(s)
        graphs.append(ReplayGraph(impl, s))
        if outputs is not None:
            outputs.append(out)
    return graphs


def count_calls(graphs: list, iters: int, warmup: int, scrub: Any) -> float:
    """10 us per call of one replay."""
    Counter.calls = 0
    graphs[0].replay()
    return 10.0 * Counter.calls


class Scrub:
    l2_bytes = 60 * 2**20

    def __call__(self) -> None:
        pass


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> bench.Env:
    import bench_utils

    fake = FakeFa3()
    fake.flash_attn_varlen_func = exact_fa3  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, FA3_MODULE, fake.module())
    for module in (bench, bench_utils):
        monkeypatch.setattr(module, "capture_graphs", replay_graphs)
        monkeypatch.setattr(module, "time_graphs", count_calls)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    cpu_layout, cpu_set = bench.make_layout, bench.make_input_set
    monkeypatch.setattr(
        bench, "make_layout", lambda case, seed=0: cpu_layout(case, seed, "cpu")
    )
    monkeypatch.setattr(
        bench, "make_input_set", lambda case, seed: cpu_set(case, seed, "cpu")
    )
    monkeypatch.setattr(
        bench,
        "make_hpc",
        lambda case, layout, ops, mode: ExactHpc(case, layout, mode),
    )
    ops = types.SimpleNamespace(
        SplitMode=types.SimpleNamespace(BALANCED="balanced", STATIC="static")
    )
    return bench.Env(hpc_ops=ops, bandwidth_gbps=1000.0, scrub=Scrub(), missing={})


def _by_impl(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["impl"]: r for r in records}


@pytest.mark.parametrize("fp8", [False, True])
def test_w1b_records(stand_ins: bench.Env, fp8: bool):
    case = bench.Case("W1B", "tp8", fp8, (128, 64), 1)
    opts = bench.Options(
        iters=50,
        warmup=1,
        baselines=("static", "fa3", "fa3_capped"),
        max_kv_bytes=10**10,
    )
    records, ok = bench.bench_chained(case, stand_ins, opts)
    assert ok
    got = _by_impl(records)
    assert list(got) == ["hpc", "static", "fa3", "fa3_capped"]
    hpc = got["hpc"]
    assert hpc["workload"] == "W1B" and hpc["case"] == case.name
    # One replay: the planner once, then 8 layers; times are per layer.
    assert hpc["us"] == pytest.approx(10.0 * (1 + 8) / 8)
    assert hpc["us_without_plan"] == pytest.approx(10.0)
    assert got["fa3"]["us"] == pytest.approx(10.0)
    assert "us_without_plan" not in got["fa3"]
    assert hpc["ratios"] == {"static": 1.0, "fa3": 0.889, "fa3_capped": 0.889}
    assert hpc["num_graphs"] == 8 and hpc["layers"] == 8
    assert hpc["floor_us"] == pytest.approx(case.floor_bytes() / 1e6, rel=1e-3)
    assert "counted" in hpc["step_work"] and "not counted" in got["fa3"]["step_work"]
    for r in records:
        assert r["ref_rel_err"] < 1e-2, r
        assert "error" not in r
    assert "num_splits=32" in got["fa3_capped"]["variant"]


def test_w1b_wrong_layer_fails_the_chained_check(
    stand_ins: bench.Env, monkeypatch: pytest.MonkeyPatch
):
    """A kernel right on the first layer but wrong on a later one (e.g. a
    workspace two layers share) is caught by the chained graph's check."""

    class LaterLayersWrong(ExactHpc):
        first: int | None = None

        def __call__(self, s: Any) -> torch.Tensor:
            out = super().__call__(s)
            if s.q.data_ptr() != self.first:
                out.mul_(2)
            return out

    def make(case, layout, ops, mode):
        return LaterLayersWrong(case, layout, mode)

    monkeypatch.setattr(bench, "make_hpc", make)
    case = bench.Case("W1B", "tp8", False, (128,), 1)
    opts = bench.Options(iters=50, warmup=1, baselines=(), max_kv_bytes=10**10)
    original = bench.check_case

    def check_then_pin(case, names, makers, first, refs):
        pinned = dict(makers)
        built = makers["hpc"]()
        built.first = first.q.data_ptr()
        pinned["hpc"] = lambda: built
        return original(case, names, pinned, first, refs)

    monkeypatch.setattr(bench, "check_case", check_then_pin)
    records, ok = bench.bench_chained(case, stand_ins, opts)
    assert not ok
    assert records[0]["us"] is None
    assert "wrong output in the chained graph: layer" in records[0]["error"]


def test_w1_records_with_fa3(stand_ins: bench.Env):
    case = bench.Case("W1", "tp8", True, (128, 64), 1)
    opts = bench.Options(
        iters=50, warmup=1, baselines=("fa3", "fa3_capped"), max_kv_bytes=10**10
    )
    records, ok = bench.bench_case(case, stand_ins, opts)
    assert ok
    got = _by_impl(records)
    assert got["hpc"]["us"] == pytest.approx(10.0)
    assert got["hpc"]["ratios"] == {"fa3": 1.0, "fa3_capped": 1.0}
    # FA3 read the E4M3 queries and is held to their reference.
    assert got["fa3"]["ref_rel_err"] < 1e-2
    assert "E4M3 queries" in got["fa3"]["variant"]
    assert set(got["hpc"]["max_abs_diff"]) == {"fa3", "fa3_capped"}
