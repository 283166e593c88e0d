# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the HPC kernel tests, their references and the HPC_ATTN backend
tests share.

* The loaders of the op module (``vllm._hpc_ops``), its validation
  (``vllm._hpc_ops_validation``) and the attention workspaces
  (``vllm.v1.attention.ops.hpc_attn_workspace``), which work with or without
  the patch set applied to an installed vLLM.
* The ``gpu`` marker and why tests carrying it cannot run here.
* Error measures, bit-exact comparison and the KV cache layouts the
  references build.
* What the decode and prefill GPU tests share: the axes their case grids
  cycle through, the option parts of a case id, the inputs' builder
  arguments, the head size x GQA ratio grid, the run-and-check of one case
  and the capture of a CUDA graph after a warm-up; and the cache arguments
  the validation of every attention op rejects.

Imports only pytest and torch (the op module when a loader or the GPU check
is called).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import importlib.util
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import torch

if TYPE_CHECKING:
    from tests.kernels.hpc.decode_reference import PagedInputs

FP8_DTYPE = torch.float8_e4m3fn

# The root of the tree that holds the ``vllm`` directory: this repository,
# or a vLLM checkout.
REPO_ROOT = next(
    (p for p in Path(__file__).resolve().parents if (p / "vllm").is_dir()),
    Path(__file__).resolve().parents[3],
)


# ---------------------------------------------------------------------------
# Locating the op module and the attention workspaces
# ---------------------------------------------------------------------------

# The patch set's modules the kernel tests use; each imports torch (and the
# modules before it) only.
HPC_OPS = "vllm._hpc_ops"
HPC_VALIDATION = "vllm._hpc_ops_validation"
ATTN_WORKSPACE = "vllm.v1.attention.ops.hpc_attn_workspace"


def _import_tree_module(repo_root: Path, name: str) -> ModuleType:
    """Import the patch-set module ``name``, preferring an installed vLLM.

    The sparse tree's ``vllm`` has no ``__init__.py``, so its directory goes
    at the end of ``sys.path``: an installed vLLM still wins, and with no vLLM
    installed the tree's ``vllm`` is a namespace package. An installed vLLM
    that the patch set was not applied to lacks the module; the tree's file
    is then loaded under that name.
    """
    if name in sys.modules:
        return sys.modules[name]
    root = str(repo_root)
    if root not in sys.path:
        sys.path.append(root)
    if "vllm" in sys.modules:
        locations = list(getattr(sys.modules["vllm"], "__path__", []))
    else:
        spec = importlib.util.find_spec("vllm")
        locations = list(spec.submodule_search_locations or []) if spec else []
    rel = Path(*name.split(".")[1:]).with_suffix(".py")
    if not any(Path(p, rel).is_file() for p in locations):
        path = repo_root / "vllm" / rel
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {name} from {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    return importlib.import_module(name)


def import_hpc_ops(repo_root: Path = REPO_ROOT) -> ModuleType:
    """Import ``vllm._hpc_ops``, preferring an installed vLLM (see
    :func:`_import_tree_module`)."""
    return _import_tree_module(repo_root, HPC_OPS)


def import_hpc_validation(repo_root: Path = REPO_ROOT) -> ModuleType:
    """Import ``vllm._hpc_ops_validation`` (the ops' argument checks), after
    the op module it imports."""
    import_hpc_ops(repo_root)
    return _import_tree_module(repo_root, HPC_VALIDATION)


def import_attn_workspace(repo_root: Path = REPO_ROOT) -> ModuleType:
    """Import ``vllm.v1.attention.ops.hpc_attn_workspace`` (the decode and
    prefill workspaces), after the modules it imports."""
    import_hpc_validation(repo_root)
    return _import_tree_module(repo_root, ATTN_WORKSPACE)


# ---------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------

GPU_MARKER = "gpu: needs an sm90 GPU and the built _hpc_C"


@functools.cache
def gpu_skip_reason() -> str | None:
    """Why ``gpu`` tests cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name()
        return f"needs an sm90 (Hopper) GPU; found {name} (sm{major}{minor})"
    if not import_hpc_ops().hpc_ops_available():
        return "the _hpc_C library is not built or could not be loaded"
    return None


def register_gpu_marker(config: pytest.Config) -> None:
    """Declare the ``gpu`` marker unless the ini file already does."""
    declared = config.getini("markers")
    if not any(str(line).startswith("gpu:") for line in declared):
        config.addinivalue_line("markers", GPU_MARKER)


def skip_gpu_tests_below(directory: Path, items: Sequence[pytest.Item]) -> None:
    """Mark the ``gpu`` tests under ``directory`` skipped, with the reason,
    when they cannot run here. Each conftest that declares the marker calls
    this for its own directory, so no test is marked twice."""
    gpu_items = [
        item
        for item in items
        if item.get_closest_marker("gpu")
        and item.path.resolve().is_relative_to(directory.resolve())
    ]
    if not gpu_items:
        return
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


# ---------------------------------------------------------------------------
# Error measures and comparisons
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class ErrorStats:
    rel: float  # ||out - ref|| / ||ref||
    max_abs: float
    finite: bool

    def __str__(self) -> str:
        return f"rel={self.rel:.3e} max_abs={self.max_abs:.3e} finite={self.finite}"


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> ErrorStats:
    """Relative Frobenius error and max abs error of ``out`` against ``ref``."""
    out = out.double()
    ref = ref.double()
    finite = bool(torch.isfinite(out).all())
    if out.numel() == 0:
        return ErrorStats(rel=0.0, max_abs=0.0, finite=True)
    diff = out - ref
    denom = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(diff).item()
    rel = num / denom if denom > 0 else num
    if not finite:
        rel = math.inf
    return ErrorStats(rel=rel, max_abs=diff.abs().max().item(), finite=finite)


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """An integer view of the same bytes (indexing and bit compares work for
    every dtype, FP8 included)."""
    size = t.element_size()
    if size == 1:
        return t.view(torch.uint8)
    if size == 2:
        return t.view(torch.int16)
    return t.view(torch.int32)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(raw_view(a), raw_view(b))


# ---------------------------------------------------------------------------
# KV cache layouts
# ---------------------------------------------------------------------------


class CacheLayout(str, enum.Enum):
    """How the ``[num_blocks, block_size, Hkv, D]`` K and V views are made."""

    # Two contiguous tensors.
    SEPARATE = "sep"
    # One (num_blocks, 2, block_size, Hkv, D) tensor: kv[:, 0] and kv[:, 1].
    STACKED = "stk"
    # vLLM's HPC backend: (num_blocks, Hkv, block_size, 2 * D), K and V side
    # by side in each row; the views are permuted slices.
    HPC = "hpc"


# ---------------------------------------------------------------------------
# Decode and prefill cases
# ---------------------------------------------------------------------------

BF16 = torch.bfloat16
FP16 = torch.float16
E5M2 = torch.float8_e5m2
HEAD_SIZES = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64)
LAYOUTS = (CacheLayout.SEPARATE, CacheLayout.STACKED, CacheLayout.HPC)
# GQA ratio -> (Hq, Hkv): two KV heads, so the work of both heads interleaves.
RATIOS = (1, 4, 5, 8, 16)
HEADS = {r: (2 * r, 2) for r in RATIOS}

DTYPE_NAMES = {BF16: "bf16", FP16: "fp16", FP8_DTYPE: "fp8"}

CaseT = TypeVar("CaseT")
InputsT = TypeVar("InputsT", bound="PagedInputs")


def option_id_parts(case: Any) -> list[str]:
    """The id parts of a case's query and output dtypes, window, soft-cap
    and scale, where they are set."""
    parts = []
    if case.q_dtype is not None:
        parts.append(f"q-{DTYPE_NAMES[case.q_dtype]}")
    if case.out_dtype is not None:
        parts.append(f"out-{DTYPE_NAMES[case.out_dtype]}")
    if case.window:
        parts.append(f"win{case.window}")
    if case.softcap:
        parts.append(f"cap{case.softcap:g}")
    if case.scale is not None:
        parts.append(f"scale{case.scale:g}")
    return parts


def build_kwargs(case: Any, seed: int) -> dict[str, object]:
    """The builder arguments every case sets (``make_decode_inputs`` and
    ``make_prefill_inputs`` alike), with ``seed``."""
    return dict(
        num_q_heads=case.heads[0],
        num_kv_heads=case.heads[1],
        head_size=case.head_size,
        block_size=case.block_size,
        kv_dtype=case.kv_dtype,
        q_dtype=case.q_dtype,
        out_dtype=case.out_dtype,
        layout=case.layout,
        scale=case.scale,
        softcap=case.softcap,
        window=case.window,
        seed=seed,
        device="cuda",
    )


def head_grid_cases(make: Callable[..., CaseT]) -> list[CaseT]:
    """Every head size x GQA ratio, cycling block sizes, layouts and 16-bit
    cache dtypes."""
    cases = []
    for i, (head_size, ratio) in enumerate(itertools.product(HEAD_SIZES, RATIOS)):
        cases.append(
            make(
                heads=HEADS[ratio],
                head_size=head_size,
                block_size=BLOCK_SIZES[i % 3],
                layout=LAYOUTS[(i // 3) % 3],
                kv_dtype=(BF16, FP16)[i % 2],
            )
        )
    return cases


def params(cases: list[Any]) -> list[object]:
    return [pytest.param(case, id=case.id) for case in cases]


def print_check(inputs: Any, what: str) -> None:
    """Checks ``inputs.out`` against the reference and prints the error."""
    stats = inputs.check(what)
    print(what, stats)


def run_and_check(inputs: InputsT, case_id: str, run: Callable[[], None]) -> InputsT:
    """Runs ``run`` on NaN-poisoned outputs, then fails if the queries
    changed and checks the output (``print_check``)."""
    q_before = inputs.q.clone()
    inputs.poison_out()
    run()
    torch.accelerator.synchronize()
    assert bitwise_equal(inputs.q, q_before), f"{case_id}: q changed"
    print_check(inputs, case_id)
    return inputs


def capture_graph(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``run``, after a warm-up run on a side stream
    (outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.accelerator.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def cache_argument_cases(
    with_args: Callable[..., dict],
    cache: Callable[..., torch.Tensor],
    blocks: int,
    block_size: int,
    kv_heads: int,
    head_size: int,
) -> dict[str, tuple[dict, str]]:
    """Validation cases ``name -> (arguments, error pattern)`` of the K/V
    cache arguments: ``with_args(**changes)`` gives an op's arguments with
    ``changes``, ``cache(shape, dtype)`` a cache tensor of the baseline
    ``[blocks, block_size, kv_heads, head_size]``."""
    cases = {
        "block-size": (
            with_args(
                key_cache=cache((blocks, 8, kv_heads, head_size)),
                value_cache=cache((blocks, 8, kv_heads, head_size)),
            ),
            "block_size",
        ),
        "cache-dtype-mismatch": (
            with_args(value_cache=cache(dtype=torch.float16)),
            "value_cache dtype",
        ),
        "cache-shape-mismatch": (
            with_args(value_cache=cache((blocks, block_size, kv_heads * 2, head_size))),
            "must match",
        ),
        "cache-not-contiguous-in-d": (
            with_args(
                key_cache=cache((blocks, block_size, head_size, kv_heads)).transpose(
                    2, 3
                )
            ),
            "key_cache must be contiguous",
        ),
    }
    # FP8 caches are E4M3 (the kernels' FP8 tensor-core path): E5M2 is
    # refused like any other unsupported dtype.
    for name, dtype in (("cache-dtype", torch.float32), ("cache-fp8-e5m2", E5M2)):
        cases[name] = (
            with_args(key_cache=cache(dtype=dtype), value_cache=cache(dtype=dtype)),
            "key_cache has dtype",
        )
    return cases
