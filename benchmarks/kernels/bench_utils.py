# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers shared by the kernel benchmarks in this directory.

Environment checks, the device-to-device copy bandwidth that every floor is
measured against (and the dense matmul rates that compute-bound floors use),
CUDA-graph capture and event timing of round-robin input sets, an L2 scrub
for rotations smaller than four times the L2 cache, random fills, paged-cache
gathers, the float32 causal reference, and what the attention benchmarks
share: the compiled FlexAttention with its paged BlockMask, the FlashInfer
paged prefill wrapper, vLLM's FlashAttention-3 (availability, cache views,
scheduler metadata) and their common options; the records, the guarded
run of one case and writing the results file that
``benchmarks/render_results.py`` reads (see the measurement protocol in the
design notes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

T = TypeVar("T")
FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------


def import_hpc_ops() -> ModuleType:
    """``vllm._hpc_ops`` from a patched vLLM, or from this tree with no vLLM.

    The tree's ``vllm`` has no ``__init__.py``, so its root goes at the end of
    ``sys.path``: an installed vLLM keeps the name and must carry the patch
    set (``tools/apply_patchset.py``).
    """
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    import vllm._hpc_ops as hpc_ops

    return hpc_ops


def import_hpc_validation() -> ModuleType:
    """``vllm._hpc_ops_validation`` (the ops' argument checks), found as
    :func:`import_hpc_ops` finds the op module."""
    import_hpc_ops()
    import vllm._hpc_ops_validation as validation

    return validation


def validated_op(
    op_name: str, hpc_ops: ModuleType | None = None
) -> Callable[..., None]:
    """The op ``op_name`` of ``vllm._hpc_ops`` (or of ``hpc_ops``), which
    checks its arguments with ``validate_<op_name>`` on its first call only:
    a wrong call fails there, naming the argument, and the timed calls are
    the op alone."""
    op = getattr(hpc_ops or import_hpc_ops(), op_name)
    validate = getattr(import_hpc_validation(), f"validate_{op_name}")
    checked = False

    def call(*args: Any, **kwargs: Any) -> None:
        nonlocal checked
        if not checked:
            validate(*args, **kwargs)
            checked = True
        op(*args, **kwargs)

    return call


def import_attn_workspace() -> ModuleType:
    """``vllm.v1.attention.ops.hpc_attn_workspace`` (the decode and prefill
    workspaces; torch and the op module only), found as
    :func:`import_hpc_ops` finds the op module."""
    import_hpc_ops()
    import vllm.v1.attention.ops.hpc_attn_workspace as workspaces

    return workspaces


def unavailable_reason() -> str | None:
    """Why the HPC kernels cannot be benchmarked here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return (
            f"needs a Hopper (sm90) GPU, found {torch.cuda.get_device_name()} "
            f"(sm{major}{minor})"
        )
    try:
        hpc_ops = import_hpc_ops()
    except Exception as err:  # noqa: BLE001 - reported, not handled
        return f"cannot import vllm._hpc_ops: {err}"
    if not hpc_ops.hpc_ops_available():
        return "the _hpc_C library is not built or could not be loaded"
    return None


def git_commit() -> str:
    """The commit measured: ``HPC_COMMIT`` when set (a copied tree has no
    git metadata, and a caller may measure a tree it has not committed),
    else the checkout's HEAD."""
    env = os.environ.get("HPC_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def sleep_ahead() -> None:
    """Keep the GPU busy while the host queues a batch of timed replays, so
    host launch latency does not land between the events."""
    torch.cuda._sleep(20_000_000)


def median_ms(events: Sequence[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    return statistics.median(start.elapsed_time(end) for start, end in events)


def new_events(n: int) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
    return [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(n)
    ]


def profiled_calls(name: str, case: str, run: Callable[[], object], runs: int) -> None:
    """The profiling scripts' loop: ``run`` called ``runs`` times with
    nothing else on the stream, each call's time printed (CUDA events, L2
    warm after the first: a quick look, not a benchmark's protocol)."""
    times = []
    for start, end in new_events(runs):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    print(f"{name}: {case}, {runs} calls, µs: {', '.join(f'{t:.1f}' for t in times)}")


def kernel_times(
    name: str, case: str, run: Callable[[], object], runs: int
) -> list[dict[str, Any]]:
    """Each kernel's device time per call of ``run`` (torch profiler over
    ``runs`` calls after a first, unprofiled one; L2 warm), in launch
    order of the first profiled call, printed and returned: where a call's
    time goes, stage by stage."""
    run()
    torch.accelerator.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(runs):
            run()
        torch.accelerator.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0)
        if device_us > 0:
            rows.append(
                {
                    "kernel": event.key[:100],
                    "calls": round(event.count / runs, 2),
                    "us": round(device_us / runs, 1),
                }
            )
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    print(f"{name}: {case}, device time per call {total:.1f} µs over {runs} calls")
    for r in rows:
        print(f"  {r['us']:9.1f} µs  {r['calls']:5.2f} launches  {r['kernel']}")
    return rows


def measure_copy_bandwidth_gbps(num_bytes: int = 2 * 2**30, iters: int = 20) -> float:
    """Device-to-device copy: (bytes read + bytes written) / median time."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.accelerator.synchronize()
    events = new_events(iters)
    sleep_ahead()
    for start, end in events:
        start.record()
        dst.copy_(src)
        end.record()
    torch.accelerator.synchronize()
    return 2 * num_bytes / (median_ms(events) * 1e-3) / 1e9


def _graph_tflops(
    impl: Callable[[object], object], n: int, iters: int, pool: tuple[int, int]
) -> float:
    graphs = capture_graphs(impl, [None], pool)
    us = time_graphs(graphs, iters, warmup=3, scrub=None)
    return 2 * n**3 / (us * 1e-6) / 1e12


def measure_matmul_tflops(
    n: int = 8192, iters: int = 30
) -> tuple[dict[str, float | None], dict[str, str]]:
    """Dense ``n`` x ``n`` x ``n`` matmul rates in TFLOP/s (2 n^3 over the
    median CUDA-graph replay): ``bf16`` by ``torch.matmul``, ``fp8`` by
    ``torch._scaled_mm`` on E4M3 operands (per-tensor scales, bf16 output,
    fast accumulation). Returns the rates (None where one could not be
    measured) and a note per rate saying how it was measured or why not."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    opts: dict[str, Any] = {"device": "cuda", "dtype": torch.bfloat16}
    a = torch.randn(n, n, generator=gen, **opts)
    b = torch.randn(n, n, generator=gen, **opts)
    c = torch.empty(n, n, **opts)
    rates: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    # One graph pool per rate: a pool whose graphs were freed cannot take a
    # new capture. Outputs are preallocated, so nothing is allocated under
    # capture.
    rates["bf16"] = _graph_tflops(
        lambda _: torch.matmul(a, b, out=c), n, iters, torch.cuda.graph_pool_handle()
    )
    notes["bf16"] = f"torch.matmul bf16 {n}x{n}x{n}"
    try:
        a8 = a.to(FP8)
        b8 = b.to(FP8).t()  # column-major, as _scaled_mm wants its mat2
        one = torch.ones((), device="cuda", dtype=torch.float32)

        def fp8_mm(_: object) -> torch.Tensor:
            return torch._scaled_mm(
                a8,
                b8,
                scale_a=one,
                scale_b=one,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
                out=c,
            )

        rates["fp8"] = _graph_tflops(fp8_mm, n, iters, torch.cuda.graph_pool_handle())
        notes["fp8"] = (
            f"torch._scaled_mm e4m3 {n}x{n}x{n}, per-tensor scales, "
            "bf16 out, fast accumulation"
        )
    except Exception as err:  # noqa: BLE001 - recorded, the caller falls back
        rates["fp8"] = None
        notes["fp8"] = f"not measured: {short_error(err)}"
    torch.accelerator.synchronize()
    return rates, notes


def floor_matmul_tflops(
    n: int = 8192, iters: int = 30
) -> tuple[dict[str, float], dict[str, float | None], dict[str, str]]:
    """The bf16 and fp8 rates that compute-bound floors divide by, measured
    by :func:`measure_matmul_tflops`. Where the fp8 rate cannot be measured,
    the floors use twice the bf16 rate (Hopper's dense FP8 peak is twice its
    BF16 peak) and its note says so. Returns (the rates the floors use, the
    rates as measured, None where not, and the notes)."""
    measured, notes = measure_matmul_tflops(n, iters)
    bf16 = measured["bf16"]
    assert bf16 is not None
    fp8 = measured["fp8"]
    if fp8 is None:
        fp8 = 2 * bf16
        notes["fp8"] += "; fp8 floors use twice the bf16 rate"
    return {"bf16": bf16, "fp8": fp8}, measured, notes


class L2Scrub:
    """Reads a buffer of four times the L2 size to evict earlier data."""

    def __init__(self) -> None:
        props = torch.cuda.get_device_properties()
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0)) or 60 * 2**20
        self.buf = torch.ones(4 * self.l2_bytes // 4096, 1024, device="cuda")
        self.out = torch.empty(1024, device="cuda")

    def __call__(self) -> None:
        torch.sum(self.buf, dim=0, out=self.out)


def fill_normal_(t: torch.Tensor, gen: torch.Generator) -> None:
    """Standard normal values; float8 tensors get bf16 draws cast in chunks
    of about 256 MB (there is no ``normal_`` for float8)."""
    if t.dtype != FP8:
        t.normal_(generator=gen)
        return
    rows = max(1, 2**27 // max(1, t[0].numel()))
    for i in range(0, t.shape[0], rows):
        part = t[i : i + rows]
        part.copy_(
            torch.randn(
                part.shape, generator=gen, device=t.device, dtype=torch.bfloat16
            )
        )


def gather_tokens(cache: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` tokens of a sequence's blocks of a ``[num_blocks,
    block_size, Hkv, D]`` cache view, float32 ``[n, Hkv, D]``."""
    raw = cache.view(torch.uint8) if cache.dtype == FP8 else cache
    rows = raw[blocks]
    rows = rows.view(FP8) if cache.dtype == FP8 else rows
    return rows.reshape(-1, *cache.shape[2:])[:n].float()


def causal_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    last: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Float32 GQA attention of query rows ``q`` ``[rows, Hq, D]`` over keys
    and values ``[n, Hkv, D]``, row ``r`` seeing the keys up to position
    ``last[r]``: ``[rows, Hq, D]``."""
    rows, hq, d = q.shape
    hkv = k.shape[1]
    q = q.view(rows, hkv, hq // hkv, d)
    scores = torch.einsum("rhgd,nhd->hgrn", q, k) * scale
    pos = torch.arange(k.shape[0], device=scores.device)
    scores.masked_fill_(pos[None, :] > last[:, None], float("-inf"))
    out = torch.einsum("hgrn,nhd->rhgd", scores.softmax(dim=-1), v)
    return out.reshape(rows, hq, d)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` in float32; inf where ``got`` is not
    finite."""
    got = got.float()
    if not torch.isfinite(got).all():
        return math.inf
    return (torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref)).item()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.float() - b.float()).abs()
    if not torch.isfinite(diff).all():
        return math.inf
    return diff.max().item()


_FLEX_FN: Callable[..., torch.Tensor] | None = None


def compiled_flex() -> Callable[..., torch.Tensor]:
    """``torch.compile(flex_attention)``, once, with static shapes (the flex
    decoding kernel needs a static batch); each case is one recompilation,
    so the recompile limit is raised."""
    global _FLEX_FN
    if _FLEX_FN is not None:
        return _FLEX_FN
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    config = torch._dynamo.config
    for names in (
        ("recompile_limit", "cache_size_limit"),
        ("accumulated_recompile_limit", "accumulated_cache_size_limit"),
    ):
        for name in names:
            if hasattr(config, name):
                setattr(config, name, 4096)
                break
    _FLEX_FN = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    return _FLEX_FN


def capture_graphs(
    impl: Callable[[T], object],
    sets: Sequence[T],
    pool: tuple[int, int],
    outputs: list[Any] | None = None,
) -> list[torch.cuda.CUDAGraph]:
    """One CUDA graph of ``impl`` per input set, after a warm-up run of every
    set on a side stream (compilation and lazy initialisation happen there,
    not under capture). ``outputs``, when given, receives what each captured
    call returned: tensors the graph rewrites at every replay, so a caller
    can check what a replay computed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets:
            impl(s)
    torch.cuda.current_stream().wait_stream(stream)
    torch.accelerator.synchronize()
    graphs = []
    for s in sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = impl(s)
        graphs.append(graph)
        if outputs is not None:
            outputs.append(out)
    return graphs


def time_graphs(
    graphs: Sequence[torch.cuda.CUDAGraph],
    iters: int,
    warmup: int,
    scrub: L2Scrub | None,
) -> float:
    """Median microseconds of one replay, replaying ``graphs`` round-robin,
    each replay timed on its own by a pair of CUDA events."""
    for i in range(warmup):
        graphs[i % len(graphs)].replay()
    torch.accelerator.synchronize()
    events = new_events(iters)
    sleep_ahead()
    for i, (start, end) in enumerate(events):
        if scrub is not None:
            scrub()
        start.record()
        graphs[i % len(graphs)].replay()
        end.record()
    torch.accelerator.synchronize()
    return median_ms(events) * 1e3


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


def significant(x: float, digits: int) -> float:
    return float(f"{x:.{digits}g}")


def write_results(
    result_name: str,
    records: list[dict[str, Any]],
    bandwidth_gbps: float,
    out_dir: Path | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Writes ``benchmarks/results/<result_name>`` (and the same file under
    ``out_dir`` when given) in the shape the design notes fix; ``extra``
    adds top-level fields after the copy bandwidth (e.g. a measured matmul
    rate, or the baselines that could not run)."""
    props = torch.cuda.get_device_properties()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "copy_bandwidth_gbps": round(bandwidth_gbps, 1),
        **(extra or {}),
        "records": records,
    }
    text = json.dumps(result, indent=1) + "\n"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / result_name).write_text(text)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / result_name).write_text(text)
    return result


def add_merge_arg(parser: argparse.ArgumentParser) -> None:
    """``--merge JSON``: keep an earlier run's records of the cases this run
    does not measure (see :func:`merge_records`)."""
    parser.add_argument(
        "--merge",
        type=Path,
        metavar="JSON",
        help="an earlier results file of this benchmark whose records of the "
        "cases this run does not measure are kept (for a run split over calls)",
    )


def merge_records(
    path: Path,
    records: list[dict[str, Any]],
    case_order: Sequence[tuple[str, str]],
    carried: Sequence[str] = (),
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``records`` plus those of the results file ``path`` that this run did
    not re-measure (by workload, case and impl), sorted by ``case_order``
    ((workload, case) pairs); and what was merged, for the JSON (``carried``:
    top-level fields of the earlier run to keep beside its commit and date).

    An hpc record measured by both runs keeps this run's time and gains the
    earlier run's ratios to baselines this run did not time: each ratio stays
    one measured in a single process (baseline and hpc side by side), only
    the processes differ between baselines."""
    old = json.loads(path.read_text())

    def key(r: dict[str, Any]) -> tuple[Any, Any, Any]:
        return (r.get("workload"), r.get("case"), r.get("impl"))

    new = {key(r): r for r in records}
    kept = []
    for r in old.get("records", []):
        mine = new.get(key(r))
        if mine is None:
            kept.append(r)
        elif r.get("impl") == "hpc":
            ratios = mine.setdefault("ratios", {})
            for name, value in r.get("ratios", {}).items():
                ratios.setdefault(name, value)
    order = {pair: i for i, pair in enumerate(case_order)}
    merged = sorted(
        kept + records,
        key=lambda r: order.get((r.get("workload"), r.get("case")), len(order)),
    )
    info = {
        "records": len(kept),
        "commit": old.get("commit"),
        "date": old.get("date"),
        "copy_bandwidth_gbps": old.get("copy_bandwidth_gbps"),
        **{field: old.get(field) for field in carried},
    }
    return merged, info


def ratios_over(timings: dict[str, float], impl: str) -> dict[str, float]:
    """Each other implementation's time over ``impl``'s: how many times
    faster ``impl`` is (empty when ``impl`` was not timed)."""
    base = timings.get(impl)
    if base is None:
        return {}
    return {other: round(t / base, 3) for other, t in timings.items() if other != impl}


def finish_run(
    result_name: str,
    records: list[dict[str, Any]],
    bandwidth_gbps: float,
    out_dir: Path | None,
    impl: str | None = None,
    started: float | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Writes the results (with ``extra`` top-level fields), then prints the
    table (of ``impl``'s records) and the time since ``started``
    (time.monotonic())."""
    write_results(result_name, records, bandwidth_gbps, out_dir, extra)
    print()
    print_table(records, impl=impl)
    if started is not None:
        print(f"elapsed {time.monotonic() - started:.1f} s")


def print_table(records: list[dict[str, Any]], impl: str | None = None) -> None:
    """Records as a text table; only those of ``impl`` when given."""
    header = (
        f"{'workload':<8} {'case':<26} {'impl':<14} {'us':>9} {'floor_us':>9} "
        f"{'frac':>6}  ratios"
    )
    print(header)
    print("-" * len(header))
    for r in records:
        if impl is not None and r["impl"] != impl:
            continue
        if r.get("us") is None:
            print(
                f"{r['workload']!s:<8} {r['case']!s:<26} {r['impl']!s:<14} "
                f"{'-':>9} {'-':>9} {'-':>6}  {r.get('error', 'not run')}"
            )
            continue
        ratios = " ".join(f"{k}={v:.2f}" for k, v in r.get("ratios", {}).items())
        floor = r.get("floor_us")
        frac = r.get("fraction_of_floor")
        print(
            f"{r['workload']!s:<8} {r['case']!s:<26} {r['impl']!s:<14} "
            f"{r['us']:>9.2f} {_fmt(floor, '9.3g')} {_fmt(frac, '6.3g')}  {ratios}"
        )


def _fmt(value: float | None, spec: str) -> str:
    width = spec.split(".")[0]
    return f"{'-':>{width}}" if value is None else f"{value:>{spec}}"


def print_progress(
    workload: str,
    name: str,
    records: list[dict[str, Any]],
    started: float,
    detail: str = "",
) -> None:
    """One line per finished case: hpc time, fraction of floor, ratios, and
    the errors of baselines that did not run."""
    hpc = records[0]
    when = f"[{time.monotonic() - started:.0f} s]"
    if hpc["us"] is None:
        print(f"  {when} {workload} {name}: hpc {hpc.get('error')}")
        return
    ratios = ", ".join(f"{k} x{v:.2f}" for k, v in hpc["ratios"].items())
    failed = [f"{r['impl']}: {r['error']}" for r in records[1:] if r.get("error")]
    print(
        f"  {when} {workload} {name}: hpc {hpc['us']} us, "
        f"{hpc['fraction_of_floor']} of floor{detail}; {ratios}"
    )
    for line in failed:
        print(f"      {line}")


def import_error(module: str, name: str | None = None) -> str | None:
    """Why ``module`` (and ``name`` in it) cannot be imported, or None."""
    try:
        found = importlib.import_module(module)
        if name is not None:
            getattr(found, name)
    except Exception as err:  # noqa: BLE001 - absent or broken
        return f"{type(err).__name__}: {err}"
    return None


def missing_baselines(
    sources: dict[str, tuple[str, str | None]], wanted: Sequence[str]
) -> dict[str, str]:
    """The wanted baselines whose (module, name) does not import, each with
    the reason (also printed)."""
    missing = {}
    for baseline, (module, name) in sources.items():
        if baseline in wanted:
            why = import_error(module, name)
            if why is not None:
                missing[baseline] = why
                print(f"{baseline} skipped: {why}")
    return missing


def missing_ops(qualified: Sequence[str]) -> list[str]:
    """The ``namespace.op`` names among ``qualified`` that ``torch.ops``
    does not hold (compiled libraries register their ops when loaded, so a
    baseline whose Python imports may still lack them)."""
    absent = []
    for name in qualified:
        namespace, op = name.split(".")
        try:
            getattr(getattr(torch.ops, namespace), op)
        except (AttributeError, RuntimeError):
            absent.append(name)
    return absent


FA3_MODULE = "vllm.vllm_flash_attn"


def fa3_unavailable_reason() -> str | None:
    """Why vLLM's FlashAttention-3 (``flash_attn_varlen_func`` with
    ``fa_version=3``) cannot run here, or None."""
    why = import_error(FA3_MODULE, "flash_attn_varlen_func")
    if why is not None:
        return why
    try:
        from vllm.vllm_flash_attn import fa_version_unsupported_reason

        return fa_version_unsupported_reason(3)
    except Exception as err:  # noqa: BLE001 - reported as the reason
        return short_error(err)


def missing_fa3(wanted: Sequence[str], names: Sequence[str]) -> dict[str, str]:
    """The baselines of ``names`` in ``wanted`` (all of them calls of
    FlashAttention-3) with the reason FA3 cannot run, each printed; empty
    when it can."""
    asked = [name for name in names if name in wanted]
    if not asked:
        return {}
    why = fa3_unavailable_reason()
    if why is None:
        return {}
    for name in asked:
        print(f"{name} skipped: {why}")
    return dict.fromkeys(asked, why)


def fa3_kv_views(
    key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[num_blocks, block_size, Hkv, D]`` cache views with canonical
    strides on size-1 dims, as vLLM's FLASH_ATTN backend passes them (FA3's
    TMA needs 16-byte aligned strides, and a size-1 head dim may carry any
    stride)."""
    try:
        from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
    except ImportError:
        return key_cache, value_cache
    return (
        canonicalize_singleton_dim_strides(key_cache),
        canonicalize_singleton_dim_strides(value_cache),
    )


def fa3_scheduler_metadata(**kwargs: Any) -> tuple[torch.Tensor | None, str | None]:
    """``get_scheduler_metadata(**kwargs)`` as vLLM's FLASH_ATTN builder
    computes it once per step, or None and why it failed (FA3 then
    schedules inside each call)."""
    try:
        from vllm.vllm_flash_attn import get_scheduler_metadata

        return get_scheduler_metadata(**kwargs), None
    except Exception as err:  # noqa: BLE001 - the caller records the reason
        return None, short_error(err)


def short_error(err: BaseException | str) -> str:
    """First line of an error, at most 300 characters, for a record."""
    text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    text = text.strip().splitlines()[0] if text.strip() else text
    return text[:300]


def sync_quietly() -> None:
    """Synchronize after a failure; a sticky CUDA error shows up in the next
    case's record instead of ending the run here."""
    with contextlib.suppress(Exception):
        torch.accelerator.synchronize()


def json_float(x: float, digits: int) -> float | str:
    return significant(x, digits) if math.isfinite(x) else "inf"


@dataclasses.dataclass
class CheckedImpls:
    """Implementations that produced a correct first output, with every
    output, error and relative error to the reference."""

    impls: dict[str, Callable[[Any], torch.Tensor]]
    outputs: dict[str, torch.Tensor]
    errors: dict[str, str]
    ref_err: dict[str, float]


def check_impls(
    names: Sequence[str],
    makers: dict[str, Callable[[], Callable[[Any], torch.Tensor]]],
    first_set: Any,
    rel_error: Callable[[torch.Tensor], float],
    tol: float,
    reference: str,
) -> CheckedImpls:
    """Builds each implementation and runs it once on ``first_set`` (whose
    ``out`` is filled with NaN first); one whose relative error to the
    reference exceeds ``tol`` is recorded as wrong and not timed."""
    checked = CheckedImpls({}, {}, {}, {})
    for name in names:
        try:
            impl = makers[name]()
            first_set.out.fill_(float("nan"))
            out = impl(first_set)
            torch.accelerator.synchronize()
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            checked.errors[name] = short_error(err)
            sync_quietly()
            continue
        checked.outputs[name] = out.clone()
        checked.ref_err[name] = rel_error(out)
        if not checked.ref_err[name] <= tol:
            checked.errors[name] = (
                f"wrong output: rel error {checked.ref_err[name]:.3g} vs "
                f"{reference} (tolerance {tol:g})"
            )
            continue
        checked.impls[name] = impl
    return checked


def make_record(
    workload: str,
    case_name: str,
    impl: str,
    us: float | None,
    floor_us: float | None,
    **extra: Any,
) -> dict[str, Any]:
    """One record of the results file; ``extra`` fields come after the
    ratios (None ``us`` or ``floor_us``: no fraction of the floor)."""
    fraction = None if us is None or floor_us is None else significant(floor_us / us, 3)
    record: dict[str, Any] = {
        "workload": workload,
        "case": case_name,
        "impl": impl,
        "us": None if us is None else round(us, 2),
        "floor_us": None if floor_us is None else significant(floor_us, 4),
        "fraction_of_floor": fraction,
        "ratios": {},
    }
    record.update(extra)
    return record


def time_impls(
    impls: dict[str, Callable[[T], object]],
    sets: Sequence[T],
    iters: int,
    warmup: int,
    scrub: L2Scrub | None,
    errors: dict[str, str],
    first: str,
) -> dict[str, float]:
    """Median microseconds of each implementation's graph replays over
    ``sets``; one that fails gets its error in ``errors``, and a failure of
    ``first`` ends the timing."""
    timings: dict[str, float] = {}
    pool = torch.cuda.graph_pool_handle()
    for name, impl in impls.items():
        try:
            graphs = capture_graphs(impl, sets, pool)
            timings[name] = time_graphs(graphs, iters, warmup, scrub)
            del graphs
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            errors[name] = short_error(err)
            torch.accelerator.synchronize()
            if name == first:
                break
    return timings


def add_run_args(
    parser: argparse.ArgumentParser,
    iters: int,
    warmup: int,
    workloads: Sequence[str],
    baselines: Sequence[str],
) -> None:
    """The options every attention benchmark takes: ``--out``, ``--iters``,
    ``--warmup``, ``--cases``, ``--workloads`` and ``--baselines``."""
    parser.add_argument("--out", type=Path, help="also write the JSON under this dir")
    parser.add_argument(
        "--iters", type=int, default=iters, help="timed replays (>= 50)"
    )
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument(
        "--cases", default="*", help="comma-separated globs over case names"
    )
    parser.add_argument(
        "--workloads",
        default=",".join(workloads),
        help="comma-separated subset of: " + ", ".join(workloads),
    )
    parser.add_argument(
        "--baselines",
        default=",".join(baselines),
        help="comma-separated subset of: "
        + ", ".join(baselines)
        + " (default: all; those that do not import are skipped)",
    )


def check_run_args(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    min_iters: int,
    workloads: Sequence[str],
    baselines: Sequence[str],
) -> None:
    """Rejects too few ``--iters`` and unknown workloads or baselines."""
    if args.iters < min_iters:
        parser.error(f"--iters must be at least {min_iters}")
    for flag, allowed in (("baselines", baselines), ("workloads", workloads)):
        unknown = set(filter(None, getattr(args, flag).split(","))) - set(allowed)
        if unknown:
            parser.error(f"unknown {flag}: {', '.join(sorted(unknown))}")


def flex_page_maps(
    pages: torch.Tensor, num_pages: int, live: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the pages ``[batch, Hkv, blocks]`` of a paged FlexAttention view
    (only those ``live`` marks, when given): each page's row ``b * Hkv + h``
    (-1 for a page no row owns) and its logical block within the row, int32
    ``[num_pages]`` each."""
    batch, hkv, nblk = pages.shape
    owner = torch.full((num_pages,), -1, dtype=torch.int32)
    logical = torch.zeros(num_pages, dtype=torch.int32)
    row_ids = torch.arange(batch * hkv).view(batch, hkv, 1).expand_as(pages)
    block_ids = torch.arange(nblk).view(1, 1, -1).expand_as(pages)
    if live is None:
        owner[pages.flatten()] = row_ids.flatten().to(torch.int32)
        logical[pages.flatten()] = block_ids.flatten().to(torch.int32)
    else:
        owner[pages[live]] = row_ids[live].to(torch.int32)
        logical[pages[live]] = block_ids[live].to(torch.int32)
    return owner, logical


def flex_paged_block_mask(
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    page_size: int,
    page_owner: torch.Tensor,
    page_logical: torch.Tensor,
    limit: torch.Tensor,
    seq_lengths: tuple[int, int],
    q_block: int = 128,
    device: str = "cuda",
) -> Any:
    """A BlockMask over paged KV whose ``mask_mod`` maps a physical position
    to its row (``page_owner``) and logical position (``page_logical``):
    query ``t`` of row ``b`` sees logical positions up to ``limit[b] + t``."""
    from torch.nn.attention.flex_attention import BlockMask

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        page = kv_idx // page_size
        pos = page_logical[page] * page_size + kv_idx % page_size
        return (page_owner[page] == b) & (pos <= limit[b] + q_idx)

    kwargs: dict[str, Any] = {
        "BLOCK_SIZE": (q_block, page_size),
        "mask_mod": mask_mod,
        "seq_lengths": seq_lengths,
    }
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
        # Without it the transposed (backward) indices are built densely
        # over every page of the cache.
        kwargs["compute_q_blocks"] = False
    return BlockMask.from_kv_blocks(
        kv_num_blocks.contiguous().to(torch.int32).to(device),
        kv_indices.contiguous().to(torch.int32).to(device),
        **kwargs,
    )


def flex_kv_views(
    kv: torch.Tensor, tokens: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[1, 1, tokens, D]`` views of a ``(num_blocks, Hkv,
    block_size, 2 * D)`` cache read as rows of 2 * D."""
    flat = kv.view(1, 1, tokens, 2 * head_size)
    return flat[..., :head_size], flat[..., head_size:]


def flashinfer_prefill_wrapper(
    workspace: torch.Tensor,
    qo_indptr: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    page_size: int,
    **plan_kwargs: Any,
) -> Any:
    """FlashInfer's paged prefill wrapper on HND cache views with a causal
    mask, planned (outside any graph) with ``plan_kwargs``."""
    import flashinfer

    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        workspace,
        "HND",
        use_cuda_graph=True,
        qo_indptr_buf=qo_indptr,
        paged_kv_indptr_buf=indptr,
        paged_kv_indices_buf=indices,
        paged_kv_last_page_len_buf=last_page_len,
    )
    wrapper.plan(
        qo_indptr,
        indptr,
        indices,
        last_page_len,
        num_q_heads,
        num_kv_heads,
        head_size,
        page_size,
        causal=True,
        **plan_kwargs,
    )
    return wrapper


def run_flashinfer_hnd(
    wrapper: Any,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    head_size: int,
    scales: dict[str, float],
) -> torch.Tensor:
    """One FlashInfer call on the HND views ``[pages, Hkv, page_size, D]``
    of a ``(num_blocks, Hkv, block_size, 2 * D)`` cache."""
    k = kv[..., :head_size]
    v = kv[..., head_size:]
    wrapper.run(q, (k, v), out=out, **scales)
    return out


class DeviceLost(RuntimeError):
    """The CUDA context failed with a sticky error (e.g. a kernel fault): no
    later case can run in this process, but the finished ones can be
    written."""


def run_guarded(
    workload: str,
    name: str,
    bench: Callable[[], tuple[list[dict[str, Any]], bool]],
    failed: Callable[[str], dict[str, Any]],
    records: list[dict[str, Any]],
    started: float,
) -> bool:
    """Runs one case's ``bench`` (its records and whether they are sound);
    an exception (e.g. out of memory) becomes the one record
    ``failed(error)`` and the run goes on. Adds the records to ``records``,
    prints the progress line and frees the cached memory; returns whether
    the case is sound. Raises :class:`DeviceLost` (after recording the case)
    when the device is no longer usable."""
    try:
        case_records, ok = bench()
    except Exception as err:  # noqa: BLE001 - e.g. out of memory: go on
        case_records = [failed(short_error(err))]
        ok = False
    records.extend(case_records)
    print_progress(workload, name, case_records, started)
    try:
        torch.accelerator.empty_cache()
    except Exception as err:  # noqa: BLE001 - any sticky error ends the run
        raise DeviceLost(short_error(err)) from err
    return ok
