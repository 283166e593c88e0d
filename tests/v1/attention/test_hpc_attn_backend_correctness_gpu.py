# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.33.0's own backend-correctness harness, run on HPC_ATTN.

``test_causal_backend_correctness`` repeats the parametrization of vLLM's
``tests/v1/attention/test_attention_backends.py::test_causal_backend_correctness``
(ten batch shapes x tensor parallel 1, 2, 4 x KV cache ``auto``, ``fp8``,
``fp8_e4m3``; Qwen3-0.6B; causal mask) for ``[AttentionBackendEnum.HPC_ATTN]``
and calls that module's ``_test_backend_correctness``, imported, not copied:
vLLM's paged cache set-up, builder and impl calls, reference and tolerances
decide. The block size is the harness default (16, which HPC_ATTN supports)
as in vLLM's test (``-k "bs16 and not rank"`` selects exactly its cases), and
also 64, the size HPC_ATTN prefers.

vLLM 0.33.0's harness simulates tensor parallelism by updating the HF config
after ``ModelConfig`` has derived its head counts, so its tensor parallel 2
and 4 cases run Qwen3-0.6B's full 16 query / 8 KV heads again.
Its ``-rank`` cases run the heads one rank has (8/4 and 4/2) as models of
their own.

vLLM's tests are not in its wheel. In a vLLM checkout the checkout's own
``tests/`` is used; elsewhere ``VLLM_SDIST`` names vLLM 0.33.0's source
distribution (``vllm-0.33.0.tar.gz``) or a directory holding its ``tests/``.
Only ``tests/v1/attention/test_attention_backends.py`` and
``tests/v1/attention/utils.py`` are read (and ``PKG-INFO``, when there, for
the version): they are staged in a temporary directory as the package
``tests`` (its ``__init__`` files empty, as vLLM's are) and imported with
that directory first on ``sys.path``; afterwards the path entry is removed
and the ``tests`` entries of ``sys.modules`` are put back as they were, so
nothing else sees them. The models are local directories holding a
``config.json`` of Qwen3-0.6B's shape (no weights, no tokenizer, no
download).

    VLLM_SDIST=path/to/vllm-0.33.0.tar.gz python -m pytest -m gpu \\
        tests/v1/attention/test_hpc_attn_backend_correctness_gpu.py

The GPU tests skip without an sm90 GPU and the built ``_hpc_C`` (see
conftest.py), without ``VLLM_SDIST``, and without vLLM's compiled cache op
(``_C_cache_ops.reshape_and_cache_flash``), through which the harness has
the impl write K/V. The CPU tests check that the harness loads without a
trace in ``sys.modules`` and builds the configurations the GPU tests run.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from vllm.config import (
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum

HARNESS = "tests.v1.attention.test_attention_backends"
# What the harness reads of vLLM's tests/, relative to the directory above it.
HARNESS_FILES = (
    "tests/v1/attention/test_attention_backends.py",
    "tests/v1/attention/utils.py",
)
# Packages above them; vLLM's own __init__ files are empty.
HARNESS_PACKAGES = ("tests", "tests/v1")
# The sdist's metadata, checked when present (a directory may lack it).
PKG_INFO = "PKG-INFO"
BASE_VERSION = "0.33.0"
SDIST_HINT = (
    "set VLLM_SDIST to vLLM 0.33.0's source distribution (vllm-0.33.0.tar.gz "
    "from PyPI) or to a directory holding its tests/ (at least "
    + " and ".join(HARNESS_FILES)
    + ")"
)

# The root that holds the ``vllm`` directory: this repository or a vLLM
# checkout.
_HERE = Path(__file__).resolve().parent
REPO_ROOT = next((p for p in _HERE.parents if (p / "vllm").is_dir()), _HERE.parent)

# Qwen/Qwen3-0.6B's config.json: the shape the harness's test runs
# (16 query heads, 8 KV heads, head size 128, bfloat16).
QWEN3_0_6B_HEADS = 16
QWEN3_0_6B_KV_HEADS = 8
QWEN3_0_6B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": QWEN3_0_6B_HEADS,
    "num_hidden_layers": 28,
    "num_key_value_heads": QWEN3_0_6B_KV_HEADS,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# vLLM's test_causal_backend_correctness parametrization.
CAUSAL_BATCH_SPECS = [
    "small_decode",
    "small_prefill",
    "mixed_small",
    "medium_decode",
    "medium_prefill",
    "mixed_medium",
    "large_decode",
    "large_prefill",
    "single_decode",
    "single_prefill",
]
TENSOR_PARALLEL_SIZES = [1, 2, 4]
KV_CACHE_DTYPES = ["auto", "fp8", "fp8_e4m3"]


# --- finding and importing vLLM's harness ---------------------------------


def _read_archive(source: Path) -> dict[str, bytes]:
    """``HARNESS_FILES`` and ``PKG-INFO`` found in the sdist ``source``."""
    wanted = {*HARNESS_FILES, PKG_INFO}
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(source) as tar:
            for member in tar:
                # Members are named <top>/<path>, e.g. vllm-0.33.0/tests/...
                rel = member.name.partition("/")[2]
                if rel in wanted and member.isfile():
                    data = tar.extractfile(member)
                    assert data is not None
                    found[rel] = data.read()
    except tarfile.ReadError as e:
        pytest.skip(
            f"VLLM_SDIST={source} is not a readable archive ({e}); {SDIST_HINT}"
        )
    return found


def _stage_harness(source: Path, dest: Path) -> None:
    """Write ``HARNESS_FILES`` of ``source`` (an sdist or a directory) under
    ``dest``, with empty ``__init__.py`` files for ``HARNESS_PACKAGES``.

    When ``source`` has the sdist's ``PKG-INFO``, it must name vLLM 0.33.0.
    """
    if source.is_dir():
        found = {
            rel: (source / rel).read_bytes()
            for rel in (*HARNESS_FILES, PKG_INFO)
            if (source / rel).is_file()
        }
    else:
        found = _read_archive(source)
    if PKG_INFO in found:
        info = found.pop(PKG_INFO).decode(errors="replace").splitlines()
        version = next((line[9:] for line in info if line.startswith("Version: ")), "")
        if version.strip() != BASE_VERSION:
            pytest.skip(
                f"VLLM_SDIST={source} is vLLM {version.strip() or '(unknown)'}, "
                f"not {BASE_VERSION}; {SDIST_HINT}"
            )
    missing = [rel for rel in HARNESS_FILES if rel not in found]
    if missing:
        pytest.skip(f"VLLM_SDIST={source} has no {', '.join(missing)}; {SDIST_HINT}")
    for package in HARNESS_PACKAGES:
        (dest / package).mkdir(parents=True, exist_ok=True)
        (dest / package / "__init__.py").write_bytes(b"")
    for rel, data in found.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)


def _is_tests_module(name: str) -> bool:
    return name == "tests" or name.startswith("tests.")


@contextlib.contextmanager
def _tests_package_from(root: Path) -> Iterator[None]:
    """Imports of ``tests.*`` resolve below ``root`` inside the block only.

    Whatever ``sys.modules`` held under ``tests`` before is put back after,
    and the modules imported inside are dropped from it (the caller keeps
    them by reference).
    """
    saved = {
        name: sys.modules.pop(name)
        for name in list(sys.modules)
        if _is_tests_module(name)
    }
    entry = str(root)
    sys.path.insert(0, entry)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(entry)
        for name in [name for name in sys.modules if _is_tests_module(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
        importlib.invalidate_caches()


def import_harness(root: Path) -> ModuleType:
    """The ``test_attention_backends`` of vLLM from ``root``/tests.

    When ``tests`` already is that package (this file runs inside the vLLM
    checkout), it is imported as usual; otherwise in isolation.
    """
    tests_dir = (root / "tests").resolve()
    current = sys.modules.get("tests")
    paths = getattr(current, "__path__", None) or []
    if any(Path(p).resolve() == tests_dir for p in paths):
        return importlib.import_module(HARNESS)
    with _tests_package_from(root):
        return importlib.import_module(HARNESS)


def harness_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory above the ``tests/`` package to import the harness from:
    the vLLM checkout this file sits in, or one staged from ``VLLM_SDIST``."""
    if all((REPO_ROOT / rel).is_file() for rel in HARNESS_FILES):
        return REPO_ROOT
    given = os.environ.get("VLLM_SDIST")
    if not given:
        pytest.skip(f"needs vLLM's test harness: {SDIST_HINT}")
    source = Path(given)
    if not source.exists():
        pytest.skip(f"VLLM_SDIST={given} does not exist; {SDIST_HINT}")
    root = tmp_path_factory.mktemp("vllm_harness")
    _stage_harness(source, root)
    return root


@pytest.fixture(scope="session")
def vllm_harness(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The ``tests/v1/attention/test_attention_backends`` module of vLLM 0.33.0."""
    return import_harness(harness_root(tmp_path_factory))


def _write_model(path: Path, num_heads: int, num_kv_heads: int) -> str:
    path.mkdir()
    config = {
        **QWEN3_0_6B_CONFIG,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)


@pytest.fixture(scope="session")
def qwen3_models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Local stand-ins (config.json only) for ``Qwen/Qwen3-0.6B`` (key 1)
    and for one rank of it under tensor parallelism 2 and 4 (keys 2, 4)."""
    root = tmp_path_factory.mktemp("models")
    return {
        tp: _write_model(
            root / ("Qwen3-0.6B" if tp == 1 else f"Qwen3-0.6B-tp{tp}-rank"),
            QWEN3_0_6B_HEADS // tp,
            QWEN3_0_6B_KV_HEADS // tp,
        )
        for tp in TENSOR_PARALLEL_SIZES
    }


@pytest.fixture
def default_vllm_config() -> Iterator[VllmConfig]:
    """As vLLM's conftest fixture of that name: a current default config."""
    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


# --- CPU: the harness loads and sees the model's shape ---------------------


@pytest.fixture
def device_platform() -> Iterator[None]:
    """A vLLM platform with a device: the current one, or, on a machine
    where vLLM finds none (DeviceConfig cannot be built), vLLM's CPU platform
    for the test's duration."""
    import vllm.platforms

    if vllm.platforms.current_platform.device_type:
        yield
        return
    from vllm.platforms.cpu import CpuPlatform

    saved = vllm.platforms._current_platform
    vllm.platforms._current_platform = CpuPlatform()
    try:
        yield
    finally:
        vllm.platforms._current_platform = saved


def _harness_vllm_config(
    harness: ModuleType, model: str, tensor_parallel_size: int
) -> VllmConfig:
    """The VllmConfig ``_test_backend_correctness`` builds (block size 16)."""
    override = None
    if tensor_parallel_size > 1:
        text_config = ModelConfig(model=model, max_model_len=1).hf_text_config
        override = {
            "num_attention_heads": text_config.num_attention_heads
            // tensor_parallel_size,
            "num_key_value_heads": max(
                1, text_config.num_key_value_heads // tensor_parallel_size
            ),
        }
    return harness.create_vllm_config(
        model_name=model,
        tensor_parallel_size=1,
        max_model_len=4096,
        block_size=16,
        num_gpu_blocks=8192,
        hf_config_override=override,
    )


@pytest.mark.parametrize(
    "model_tp, harness_tp, heads",
    [
        pytest.param(1, 1, (16, 8), id="tp1"),
        # vLLM 0.33.0's harness updates hf_config after ModelConfig has
        # derived its head counts, so its tensor parallel 2 and 4 cases run
        # all 16/8 heads again; the rank models give the per-rank shapes.
        pytest.param(1, 2, (16, 8), id="tp2"),
        pytest.param(1, 4, (16, 8), id="tp4"),
        pytest.param(2, 1, (8, 4), id="tp2-rank"),
        pytest.param(4, 1, (4, 2), id="tp4-rank"),
    ],
)
def test_harness_configures_local_qwen3(
    device_platform: None,
    vllm_harness: ModuleType,
    qwen3_models: dict[int, str],
    model_tp: int,
    harness_tp: int,
    heads: tuple[int, int],
) -> None:
    assert callable(vllm_harness._test_backend_correctness)
    assert set(CAUSAL_BATCH_SPECS) <= set(vllm_harness.BATCH_SPECS)

    config = _harness_vllm_config(vllm_harness, qwen3_models[model_tp], harness_tp)
    model = config.model_config
    parallel = config.parallel_config
    assert model.get_num_attention_heads(parallel) == heads[0]
    assert model.get_num_kv_heads(parallel) == heads[1]
    assert model.get_head_size() == 128
    assert model.dtype == torch.bfloat16
    assert model.get_sliding_window() is None
    assert config.cache_config.block_size == 16


def test_harness_import_leaves_no_trace(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = harness_root(tmp_path_factory)
    if root == REPO_ROOT:
        pytest.skip("imported as the checkout's own tests package")
    stand_in = ModuleType("tests")
    monkeypatch.setitem(sys.modules, "tests", stand_in)
    # This tree's own helpers (tests.kernels.hpc.*) may be imported already.
    for name in [n for n in sys.modules if n.startswith("tests.")]:
        monkeypatch.delitem(sys.modules, name)
    path = list(sys.path)
    harness = import_harness(root)
    assert harness.__name__ == HARNESS
    assert harness.__file__ is not None
    assert Path(harness.__file__).is_relative_to(root)
    assert sys.path == path
    assert sys.modules["tests"] is stand_in
    assert not [n for n in sys.modules if n.startswith("tests.")]


# --- GPU: vLLM's test_causal_backend_correctness on HPC_ATTN ---------------


def _has_vllm_cache_op() -> bool:
    try:
        return hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash")
    except (AttributeError, RuntimeError):
        return False


def _causal_mask_mod(
    b: torch.Tensor,
    h: torch.Tensor,
    q_idx: torch.Tensor,
    kv_idx: torch.Tensor,
    *,
    context_len: int,
) -> torch.Tensor:
    # vLLM's test_causal_backend_correctness passes this mask.
    return (q_idx + context_len) >= kv_idx


def _run_harness(
    harness: ModuleType,
    model: str,
    batch_spec_name: str,
    block_size: int,
    tensor_parallel_size: int,
    kv_cache_dtype: str,
) -> None:
    if not _has_vllm_cache_op():
        pytest.skip(
            "vLLM's compiled cache op (_C_cache_ops.reshape_and_cache_flash), "
            "through which the harness has the impl write K/V, is not loaded"
        )
    backend = AttentionBackendEnum.HPC_ATTN
    # The harness passes over a backend that refuses an FP8 cache dtype
    # without a word; HPC_ATTN must not be one.
    assert backend.get_class().supports_kv_cache_dtype(kv_cache_dtype)

    harness._test_backend_correctness(
        harness.BATCH_SPECS[batch_spec_name],
        model,
        [backend],
        _causal_mask_mod,
        block_size=block_size,
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_dtype=kv_cache_dtype,
    )


# (tensor parallel size passed to the harness, model heads of that many
# ranks): vLLM's cases, then the heads one rank has at tensor parallel 2
# and 4 (8/4 and 4/2) with the harness told tensor parallel 1.
HARNESS_CASES = [
    *[pytest.param(tp, 1, id=f"tp{tp}") for tp in TENSOR_PARALLEL_SIZES],
    *[pytest.param(1, tp, id=f"tp{tp}-rank") for tp in TENSOR_PARALLEL_SIZES[1:]],
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch_spec_name", CAUSAL_BATCH_SPECS)
@pytest.mark.parametrize(("tensor_parallel_size", "model_ranks"), HARNESS_CASES)
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("block_size", [16, 64], ids=["bs16", "bs64"])
def test_causal_backend_correctness(
    default_vllm_config: VllmConfig,
    vllm_harness: ModuleType,
    qwen3_models: dict[int, str],
    block_size: int,
    kv_cache_dtype: str,
    tensor_parallel_size: int,
    model_ranks: int,
    batch_spec_name: str,
) -> None:
    """The test_causal_backend_correctness of vLLM, HPC_ATTN as the backend; the
    ``-rank`` cases on the heads of one rank, which vLLM 0.33.0's harness
    means to run at tensor parallel 2 and 4 but does not."""
    _run_harness(
        vllm_harness,
        qwen3_models[model_ranks],
        batch_spec_name,
        block_size,
        tensor_parallel_size,
        kv_cache_dtype,
    )
