# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Workload E2E: vLLM end to end with ``HPC_ATTN`` against vLLM's own backends.

Each run builds one ``LLM`` (dummy weights, a local config of 2-4 layers)
in its own subprocess, with CUDA graphs and compilation as vLLM does by
default, and drives the engine step by step:

* ``decode``: one 32768-token and 31 4096-token requests are prefilled, then
  generate; the median time of the steps in which all 32 requests decode.
* ``prefill``: the time to the first token of one 32768-token prompt
  (median of three fresh prompts; prefix caching is off).
* agreement: the top log-probabilities of four greedy steps on four short
  prompts, compared with the ``TRITON_ATTN`` and ``FLASH_ATTN`` runs of the
  same model and KV dtype (the dummy weights are replaced by seeded normal
  ones first, so the models compute something non-trivial and the same in
  every run).

Models (``--models``): ``llama`` (GQA 4, no QK-norm: the fused prologue
through vLLM's RoPE + KV-cache pass), ``qwen3`` (GQA 5, QK-norm: the fused
prologue through vLLM's QK-norm + RoPE + KV-cache pass; both passes with the
README's compilation settings under ``HPC_ATTN``), ``hy3`` (64/8 heads,
QK-norm through the model's own ``HpcRopeNorm``, FP8 experts with
``--moe-backend hpc`` in every run). KV dtypes (``--kv``): ``bf16`` and
``fp8``. Backends (``--backends``): ``HPC_ATTN``, ``TRITON_ATTN``,
``FLASH_ATTN`` (needs vLLM's compiled ops).

MoE backends (``--moe-backends``, Hy3 only): ``hpc`` (``--moe-backend hpc``,
every run of the tables above) and ``vllm`` (vLLM's own choice for the FP8
experts, no ``--moe-backend``). Where both ran for the same model, KV dtype
and attention backend, ``E2E_MOE`` records compare them: case
``<model>-<kv>-<attention impl>-<decode|prefill>``, ``impl`` ``hpc`` or
``vllm_moe``, so the time to first token shows the MoE alone.

Case names: ``<model>-<bf16|fp8>-<decode|prefill>``; ``impl`` is ``hpc``,
``triton_attn`` or ``flash_attn``; the ``hpc`` records carry ``ratios``
over the others. Writes ``benchmarks/results/benchmark_e2e.json`` (and under
``--out``).

usage: python benchmarks/benchmark_e2e.py [--models hy3] [--kv bf16,fp8]
           [--backends HPC_ATTN,TRITON_ATTN,FLASH_ATTN] [--layers 2] [--out DIR]
           [--profile [--trace]]

``--profile`` records, per run, the kernels that took the most device time in
four decode steps (``decode_kernels`` in ``runs.json``), the device time of
all their kernels (``decode_device_us_per_step``) and the host operators with
the most CPU time of their own (``decode_host_ops``), to tell where one
backend's step time goes against another's; the decode records then carry
``attn_kernel_us_per_layer``, the device time of the backend's own decode
attention kernels per layer (``ATTENTION_KERNELS``), and
``fused_prologue_calls_per_layer``, the launches of the fused prologue's
kernel per layer and step (1 where HpcRopeNorm or a fusion pass fused it).
It also profiles one more prefill of the long prompt after the timed ones
(``prefill_kernels``, ``prefill_device_us``); the ``E2E`` and ``E2E_MOE`` records
then carry ``device_us``, the device time of all kernels in the profiled step,
whose ratio between backends holds apart from the host's share and from the
spread of wall-clock time between runs (``device_ratios`` on the hpc record).
With ``--trace`` the profiled steps' timeline is written too, one gzipped
Chrome trace per run in the output directory: the order of the host's work
and the kernels within a step, which the tables do not keep.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "kernels"))

import bench_utils  # noqa: E402

RESULT_NAME = "benchmark_e2e.json"
IMPL_NAMES = {
    "HPC_ATTN": "hpc",
    "TRITON_ATTN": "triton_attn",
    "FLASH_ATTN": "flash_attn",
}
KV_DTYPES = {"bf16": "auto", "fp8": "fp8"}
# The MoE backends a Hy3 run may take: the value of vLLM's --moe-backend,
# or None for vLLM's own choice; record impl names of the E2E_MOE records.
MOE_BACKENDS: dict[str, str | None] = {"hpc": "hpc", "vllm": None}
MOE_IMPL_NAMES = {"hpc": "hpc", "vllm": "vllm_moe"}
MOE_MODELS = ("hy3",)

# A run's timed phases: the fields holding their wall-clock times and the
# device times of their profiled steps (--profile).
TIMED_FIELDS = (
    ("decode", "decode_step_us", "decode_device_us_per_step"),
    ("prefill", "prefill_us", "prefill_device_us"),
)

LONG_PROMPT = 32768
SHORT_PROMPT = 4096
NUM_SHORT = 31
DECODE_STEPS = 40  # generated tokens per request in the decode measurement
TIMED_DECODE_STEPS = 24  # the last ones, when every request decodes
PREFILL_REPEATS = 3
AGREEMENT_PROMPTS = 4
AGREEMENT_STEPS = 4
AGREEMENT_LOGPROBS = 5
VOCAB = 32000

_COMMON = {
    "vocab_size": VOCAB,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 128,
}

# The vLLM fusion pass that gives a model without HpcRopeNorm the fused
# prologue under HPC_ATTN (Qwen3 has per-head QK-norm, Llama has none).
FUSION_PASS = {
    "qwen3": "fuse_qk_norm_rope_kvcache",
    "llama": "fuse_rope_kvcache",
}

# The shapes of the named models; ``num_hidden_layers`` comes from --layers.
MODELS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "rope_theta": 1000000.0,
    },
    "hy3": {
        "architectures": ["HYV3ForCausalLM"],
        "model_type": "hy_v3",
        "hidden_size": 4096,
        "intermediate_size": 13312,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_experts": 192,
        "num_experts_per_tok": 8,
        "num_shared_experts": 1,
        "moe_intermediate_size": 1536,
        "expert_hidden_dim": 1536,
        "first_k_dense_replace": 0,
        "route_norm": True,
        "router_scaling_factor": 2.826,
        "rope_parameters": {"rope_type": "default", "rope_theta": 11158840.0},
        # A block-wise FP8 checkpoint: 128x128 weight blocks, dynamic 1x128
        # activation groups.
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    },
}


def _model_config(model: str, layers: int) -> dict[str, Any]:
    config = json.loads(json.dumps({**_COMMON, **MODELS[model]}))
    config["num_hidden_layers"] = layers
    if model == "hy3":
        config["mlp_layer_types"] = ["sparse"] * layers
        # The attention projections stay bf16: FP8 dummy weights are left as
        # loaded (tiny), which would make attention's share of the logits
        # vanish and the agreement check say nothing.
        config["quantization_config"]["ignored_layers"] = [
            f"model.layers.{i}.self_attn.{proj}"
            for i in range(layers)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
        ]
    return config


# ---------------------------------------------------------------------------
# One run (in a subprocess)
# ---------------------------------------------------------------------------


def _reinit_weights(worker: Any, seed: int) -> int:
    """Replaces the dummy weights by seeded normal ones (std 0.02, unit
    norms, zero biases, unit-variance embeddings), in place so captured
    graphs keep their addresses. FP8 weights and all scales are left as
    loaded. Returns the number of tensors written."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    model = worker.model_runner.model
    written = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if not p.dtype.is_floating_point or p.element_size() == 1:
                continue
            if "scale" in name:
                continue
            if "norm" in name:
                p.fill_(1.0)
            elif "bias" in name:
                p.zero_()
            else:
                std = 1.0 if "embed" in name else 0.02
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * std)
            written += 1
    return written


def _step_until_done(
    engine: Any, profile_steps: range = range(0), trace: Path | None = None
) -> tuple[list[float], dict[str, Any] | None]:
    """Steps the engine until its requests finish: the seconds of each step,
    and the profile of the steps whose index is in ``profile_steps`` (those
    run under the profiler and are not timed: the profiler slows them).
    ``trace``: where the profiled steps' timeline goes as a gzipped Chrome
    trace (host operators and kernels in order, which the tables lose)."""
    import torch

    times: list[float] = []
    kernels = None
    profiler = None
    step = 0
    while engine.has_unfinished_requests():
        if profile_steps and step == profile_steps.start:
            profiler = torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            )
            profiler.start()
        t0 = time.perf_counter()
        engine.step()
        torch.accelerator.synchronize()
        if profiler is None:
            times.append(time.perf_counter() - t0)
        step += 1
        if profiler is not None and step == profile_steps.stop:
            profiler.stop()
            kernels = _kernel_table(profiler, len(profile_steps))
            if trace is not None:
                _write_trace(profiler, trace)
            profiler = None
    return times, kernels


def _write_trace(profiler: Any, path: Path) -> None:
    import gzip
    import shutil

    raw = path.with_suffix("")  # the profiler writes plain JSON
    profiler.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


PROFILE_KERNELS = 25
PROFILE_HOST_OPS = 15
# The fused prologue's kernel (HpcRopeNorm and the fusion-pass hooks): one
# launch per layer and step when the model or a fusion pass uses it.
PROLOGUE_KERNEL = "rope_norm_kernel"


def _kernel_table(profiler: Any, steps: int) -> dict[str, Any]:
    """Per step: the kernels that took the most device time, the device
    time of all kernels, and the host-side operators that took the most CPU
    time of their own (a step is synchronous, so its time is the host's work
    plus the device's). Only device events count as device time: the
    profiler also gives each host operator the time of the kernels it
    launched, which would count them twice."""
    from torch.autograd import DeviceType

    kernels = []
    host = []
    device_total = 0.0
    prologue_calls = 0
    for event in profiler.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0)
        if event.device_type != DeviceType.CPU and device_us > 0:
            device_total += device_us
            if PROLOGUE_KERNEL in event.key:
                prologue_calls += event.count
            kernels.append(
                {
                    "kernel": event.key[:120],
                    "us_per_step": round(device_us / steps, 1),
                    "calls_per_step": round(event.count / steps, 2),
                }
            )
        elif event.self_cpu_time_total > 0:
            host.append(
                {
                    "op": event.key[:120],
                    "cpu_us_per_step": round(event.self_cpu_time_total / steps, 1),
                    "calls_per_step": round(event.count / steps, 2),
                }
            )
    kernels.sort(key=lambda r: -r["us_per_step"])
    host.sort(key=lambda r: -r["cpu_us_per_step"])
    return {
        "kernels": kernels[:PROFILE_KERNELS],
        "device_us_per_step": round(device_total / steps, 1),
        "host_ops": host[:PROFILE_HOST_OPS],
        "prologue_calls_per_step": round(prologue_calls / steps, 2),
    }


def _prompt(rng: Any, n: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(n)]}


def _has_vllm_compiled_ops() -> bool:
    import torch

    import vllm._custom_ops  # noqa: F401

    try:
        return hasattr(torch.ops._C, "rms_norm")
    except (AttributeError, RuntimeError):
        return False


def run_one(
    model: str,
    kv: str,
    backend: str,
    layers: int,
    path: Path,
    profile: bool,
    trace_dir: Path | None = None,
    moe: str = "hpc",
) -> None:
    """Builds the LLM, measures, and writes the result to ``path``;
    ``profile``: also the kernels of a few decode steps, and with
    ``trace_dir`` their timeline (``<run name>.trace.json.gz``); ``moe``:
    the MoE backend of a model with experts (``MOE_BACKENDS``)."""
    import random

    from vllm import LLM, SamplingParams

    result = run_entry(model, kv, backend, moe)
    model_dir = Path(tempfile.mkdtemp(prefix=f"e2e_{model}_"))
    config = _model_config(model, layers)
    if model == "hy3":
        try:
            from transformers import HYV3Config  # noqa: F401
        except ImportError:
            # An older transformers: a config class that keeps the extra
            # fields as attributes serves the same model.
            config["model_type"] = "qwen3"
    (model_dir / "config.json").write_text(json.dumps(config))
    compilation: dict[str, Any] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
    kwargs: dict[str, Any] = {}
    if not _has_vllm_compiled_ops():
        # Native norms and activations where vLLM's compiled ops are absent.
        compilation["custom_ops"] = ["none"]
        kwargs["kernel_config"] = {
            "ir_op_priority": {
                "rms_norm": ["native"],
                "fused_add_rms_norm": ["native"],
            }
        }
    if backend == "HPC_ATTN" and model in FUSION_PASS:
        # The README's settings for models that do not wire HpcRopeNorm.
        compilation["pass_config"] = {FUSION_PASS[model]: True}
        compilation["use_inductor_graph_partition"] = True
    if model in MOE_MODELS and MOE_BACKENDS[moe] is not None:
        kwargs["moe_backend"] = MOE_BACKENDS[moe]
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        attention_backend=backend,
        kv_cache_dtype=KV_DTYPES[kv],
        compilation_config=compilation,
        gpu_memory_utilization=0.5,
        max_model_len=LONG_PROMPT + 1024,
        max_num_seqs=32,
        max_num_batched_tokens=LONG_PROMPT,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        seed=0,
        **kwargs,
    )
    result["init_s"] = round(time.perf_counter() - t0, 1)
    result["vllm_compiled_ops"] = "custom_ops" not in compilation
    result["reinit_tensors"] = llm.collective_rpc(_reinit_weights, args=(1234,))[0]
    engine = llm.llm_engine
    rng = random.Random(0)

    # Agreement: greedy top log-probabilities.
    params = SamplingParams(
        max_tokens=AGREEMENT_STEPS,
        temperature=0.0,
        logprobs=AGREEMENT_LOGPROBS,
        detokenize=False,
        ignore_eos=True,
    )
    prompts = [_prompt(rng, 300 + 700 * i) for i in range(AGREEMENT_PROMPTS)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result["agreement"] = [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [
                {str(t): lp.logprob for t, lp in step.items()}
                for step in o.outputs[0].logprobs
            ],
        }
        for o in outs
    ]

    # Decode: the mixed batch.
    params = SamplingParams(
        max_tokens=DECODE_STEPS, temperature=0.0, detokenize=False, ignore_eos=True
    )
    lengths = [LONG_PROMPT] + [SHORT_PROMPT] * NUM_SHORT
    for i, n in enumerate(lengths):
        engine.add_request(f"decode-{i}", _prompt(rng, n), params)
    # Profiled: a few steps just before the timed ones end, all decodes.
    profiled = range(DECODE_STEPS - 8, DECODE_STEPS - 4) if profile else range(0)
    trace = (
        trace_dir / f"{run_name(result)}.trace.json.gz"
        if profile and trace_dir is not None
        else None
    )
    steps, profile_table = _step_until_done(engine, profiled, trace)
    result["decode_step_us"] = statistics.median(steps[-TIMED_DECODE_STEPS:]) * 1e6
    if profile_table is not None:
        result["decode_kernels"] = profile_table["kernels"]
        result["decode_device_us_per_step"] = profile_table["device_us_per_step"]
        result["decode_host_ops"] = profile_table["host_ops"]
        result["prologue_calls_per_step"] = profile_table["prologue_calls_per_step"]
    result["decode_steps"] = len(steps)

    # Prefill: one long prompt, a token out.
    params = SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True
    )
    ttft = []
    for i in range(PREFILL_REPEATS + 1):
        engine.add_request(f"prefill-{i}", _prompt(rng, LONG_PROMPT), params)
        ttft.append(sum(_step_until_done(engine)[0]))
    result["prefill_us"] = statistics.median(ttft[1:]) * 1e6  # the first warms up
    if profile:
        # One more, profiled: the prompt is one step (max_num_batched_tokens).
        engine.add_request("prefill-profiled", _prompt(rng, LONG_PROMPT), params)
        _, table = _step_until_done(engine, range(0, 1))
        assert table is not None
        result["prefill_kernels"] = table["kernels"]
        result["prefill_device_us"] = table["device_us_per_step"]
    path.write_text(json.dumps(result))


# ---------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------


def run_entry(model: str, kv: str, backend: str, moe: str) -> dict[str, Any]:
    """A run's identifying fields (``moe`` only for a model with experts)."""
    entry: dict[str, Any] = {"model": model, "kv": kv, "backend": backend}
    if model in MOE_MODELS:
        entry["moe"] = moe
    return entry


def run_name(run: dict[str, Any]) -> str:
    """``<model>-<kv>-<backend>``, and ``-moe-<backend>`` for a MoE model's
    run off ``--moe-backend hpc``."""
    name = f"{run['model']}-{run['kv']}-{run['backend']}"
    moe = run.get("moe", "hpc")
    return name if moe == "hpc" else f"{name}-moe-{moe}"


def _agreement(hpc: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Greedy-token agreement and the largest log-probability difference
    over the tokens both runs list, at the steps whose prefixes agree."""
    same_first = 0
    same_all = 0
    max_diff = 0.0
    compared = 0
    for a, b in zip(hpc["agreement"], ref["agreement"], strict=True):
        same_first += a["tokens"][:1] == b["tokens"][:1]
        same_all += a["tokens"] == b["tokens"]
        for step, (la, lb) in enumerate(zip(a["logprobs"], b["logprobs"], strict=True)):
            if a["tokens"][:step] != b["tokens"][:step]:
                break
            for token in set(la) & set(lb):
                max_diff = max(max_diff, abs(la[token] - lb[token]))
                compared += 1
    n = len(hpc["agreement"])
    return {
        "same_first_token": f"{same_first}/{n}",
        "same_tokens": f"{same_all}/{n}",
        "max_abs_logprob_diff": round(max_diff, 4),
        "logprobs_compared": compared,
    }


# Name parts of each backend's decode attention kernels in a profile (its
# per-step planners and the rest of the step are not counted).
ATTENTION_KERNELS = {
    "HPC_ATTN": ("hpc::decode::decode_",),
    "FLASH_ATTN": ("flash::FlashAttnFwd",),
    "TRITON_ATTN": ("kernel_unified_attention", "reduce_segments"),
}


def attention_us_per_layer(run: dict[str, Any], layers: int) -> float | None:
    """Device time of the run's decode attention kernels per layer in a
    profiled decode step (``--profile``), or None without a profile."""
    kernels = run.get("decode_kernels")
    if not kernels:
        return None
    parts = ATTENTION_KERNELS[run["backend"]]
    total = sum(
        k["us_per_step"] for k in kernels if any(x in k["kernel"] for x in parts)
    )
    return round(total / layers, 2)


def _device_fields(
    ran: dict[str, dict[str, Any]], device_field: str, impl: str
) -> dict[str, Any]:
    """The profiled device time of ``impl``'s run among ``ran`` (runs by impl
    name, side by side) and, on the hpc record, its ratios to the others'
    when every run has one."""
    devices = {i: run[device_field] for i, run in ran.items() if device_field in run}
    fields: dict[str, Any] = {}
    if impl in devices:
        fields["device_us"] = devices[impl]
    if impl == "hpc" and len(devices) == len(ran) > 1:
        fields["device_ratios"] = bench_utils.ratios_over(devices, "hpc")
    return fields


def _moe_records(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """E2E_MOE records: a MoE model's runs on each MoE backend side by side,
    for each KV dtype and attention backend that ran on more than one."""
    records = []
    by_key = {
        (r["model"], r["kv"], r["backend"], r["moe"]): r
        for r in runs
        if "error" not in r and "moe" in r
    }
    for model, kv, backend in sorted({k[:3] for k in by_key}):
        ran = {
            MOE_IMPL_NAMES[moe]: by_key[(model, kv, backend, moe)]
            for moe in MOE_BACKENDS
            if (model, kv, backend, moe) in by_key
        }
        if len(ran) < 2:
            continue
        for what, field, device_field in TIMED_FIELDS:
            timings = {impl: run[field] for impl, run in ran.items()}
            for impl, us in timings.items():
                extra: dict[str, Any] = {"init_s": ran[impl]["init_s"]}
                extra |= _device_fields(ran, device_field, impl)
                if impl == "hpc":
                    extra["ratios"] = bench_utils.ratios_over(timings, "hpc")
                records.append(
                    bench_utils.make_record(
                        "E2E_MOE",
                        f"{model}-{kv}-{IMPL_NAMES[backend]}-{what}",
                        impl,
                        us,
                        None,
                        **extra,
                    )
                )
    return records


def _records(runs: list[dict[str, Any]], layers: int) -> list[dict[str, Any]]:
    """The E2E records of the runs with ``--moe-backend hpc`` (every run of
    a model without experts), then the E2E_MOE records."""
    records = []
    moe_records = _moe_records(runs)
    runs = [r for r in runs if r.get("moe", "hpc") == "hpc"]
    by_key = {(r["model"], r["kv"], r["backend"]): r for r in runs if "error" not in r}
    for model, kv in sorted({(r["model"], r["kv"]) for r in runs}):
        hpc = by_key.get((model, kv, "HPC_ATTN"))
        ran = {
            IMPL_NAMES[b]: by_key[(model, kv, b)]
            for b in IMPL_NAMES
            if (model, kv, b) in by_key
        }
        for what, field, device_field in TIMED_FIELDS:
            timings = {impl: run[field] for impl, run in ran.items()}
            for impl, us in timings.items():
                run = ran[impl]
                extra: dict[str, Any] = {"init_s": run["init_s"]}
                extra |= _device_fields(ran, device_field, impl)
                attn_us = attention_us_per_layer(run, layers)
                if what == "decode" and attn_us is not None:
                    extra["attn_kernel_us_per_layer"] = attn_us
                if what == "decode" and "prologue_calls_per_step" in run:
                    extra["fused_prologue_calls_per_layer"] = round(
                        run["prologue_calls_per_step"] / layers, 2
                    )
                if impl == "hpc" and what == "decode":
                    for ref_backend in ("TRITON_ATTN", "FLASH_ATTN"):
                        ref = by_key.get((model, kv, ref_backend))
                        if ref is not None:
                            extra[f"agreement_{IMPL_NAMES[ref_backend]}"] = _agreement(
                                hpc, ref
                            )
                record = bench_utils.make_record(
                    "E2E", f"{model}-{kv}-{what}", impl, us, None, **extra
                )
                if impl == "hpc":
                    record["ratios"] = bench_utils.ratios_over(timings, "hpc")
                records.append(record)
    return records + moe_records


def _run_in_subprocess(
    args: argparse.Namespace,
    model: str,
    kv: str,
    backend: str,
    moe: str,
    out: Path,
    work: Path,
) -> dict[str, Any]:
    """One run (``--one``) in a subprocess of its own; its result, or the
    error it ended with."""
    entry = run_entry(model, kv, backend, moe)
    name = run_name(entry)
    path = work / f"{name}.json"
    cmd = [sys.executable, __file__, "--layers", str(args.layers)]
    cmd += ["--profile"] if args.profile else []
    cmd += ["--trace", "--out", str(out)] if args.trace else []
    cmd += ["--one", model, kv, backend, str(path), "--moe", moe]
    t0 = time.monotonic()
    with (out / "e2e_runs.log").open("a") as f:
        f.write(f"=== {name}\n")
        f.flush()
        try:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if path.is_file():
        entry = json.loads(path.read_text())
    else:
        entry["error"] = f"exit {rc}; see e2e_runs.log"
    print(
        f"{name:32} {time.monotonic() - t0:6.1f} s "
        + (
            entry.get("error")
            or (
                f"decode {entry['decode_step_us']:9.0f} us  "
                f"prefill {entry['prefill_us']:9.0f} us  "
                f"init {entry['init_s']} s"
            )
        ),
        flush=True,
    )
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,qwen3,hy3")
    parser.add_argument("--kv", default="bf16,fp8")
    parser.add_argument("--backends", default=",".join(IMPL_NAMES))
    parser.add_argument(
        "--moe-backends",
        default="hpc",
        help="MoE backends of the models with experts: "
        + ", ".join(MOE_BACKENDS)
        + " (vllm: vLLM's own choice)",
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--merge", type=Path, help="runs of an earlier call (runs.json)"
    )
    parser.add_argument("--timeout", type=int, default=400, help="seconds per run")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="record the kernels of a few decode steps in runs.json",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="with --profile: also their timeline, as gzipped Chrome traces "
        "in the output directory",
    )
    parser.add_argument("--one", nargs=4, metavar=("MODEL", "KV", "BACKEND", "PATH"))
    parser.add_argument("--moe", default="hpc", help="with --one: its MoE backend")
    args = parser.parse_args()
    if args.one:
        model, kv, backend, path = args.one
        run_one(
            model,
            kv,
            backend,
            args.layers,
            Path(path),
            args.profile,
            args.out if args.trace else None,
            args.moe,
        )
        return
    if not 2 <= args.layers <= 4:
        parser.error("--layers: 2..4")
    if args.trace and not args.profile:
        parser.error("--trace records the profiled steps: it needs --profile")
    for flag, allowed in (
        ("models", MODELS),
        ("kv", KV_DTYPES),
        ("backends", IMPL_NAMES),
        ("moe_backends", MOE_BACKENDS),
    ):
        unknown = set(getattr(args, flag).split(",")) - set(allowed)
        if unknown:
            parser.error(f"unknown {flag}: {', '.join(sorted(unknown))}")

    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    if args.merge is not None:
        runs = json.loads(args.merge.read_text())
    out = args.out or Path(tempfile.mkdtemp(prefix="e2e_"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="e2e_runs_"))
    for model in args.models.split(","):
        moes = args.moe_backends.split(",") if model in MOE_MODELS else ["hpc"]
        for kv in args.kv.split(","):
            for backend in args.backends.split(","):
                for moe in moes:
                    entry = _run_in_subprocess(args, model, kv, backend, moe, out, work)
                    runs.append(entry)
                    (out / "runs.json").write_text(json.dumps(runs))
    failed = {run_name(r): r["error"] for r in runs if "error" in r}
    import torch

    bench_utils.finish_run(
        RESULT_NAME,
        _records(runs, args.layers),
        bandwidth_gbps=bench_utils.measure_copy_bandwidth_gbps(),
        out_dir=out,
        impl="hpc",
        started=started,
        extra={
            "layers": args.layers,
            "failed_runs": failed,
            "device": torch.cuda.get_device_name(),
        },
    )
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
