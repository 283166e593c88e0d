# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Asks vLLM's edited backend-correctness test what it would run, on a CPU.

Run by ``test_apply_patchset.py`` inside a vLLM checkout with the patch set
applied, with the checkout first on ``PYTHONPATH`` (its ``vllm`` sources and
its ``tests`` package)::

    python backend_tests_probe.py MODEL_DIR GQA32_MODEL_DIR

Prints one JSON object: which of the module's backend lists hold HPC_ATTN,
the reasons ``_selection_refusals`` gives for a few configurations on a
stand-in Hopper (9.0) and Ampere (8.0) device, and the skip reason of
``_test_backend_correctness`` when its only backend is refused. The device
capability is the only thing posed; the kernel library's presence is taken
as given (``has_hpc_kernels``), so the answers do not depend on a build.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import pytest
import torch

import vllm.platforms
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import DeviceCapability

HOPPER = DeviceCapability(9, 0)
AMPERE = DeviceCapability(8, 0)


def main(model: str, gqa32_model: str) -> dict[str, Any]:
    # A platform with a device (vLLM's CPU one where none is found), posing
    # as the GPU of the case. The process ends after, so nothing is undone.
    mp = pytest.MonkeyPatch()
    if not vllm.platforms.current_platform.device_type:
        mp.setattr(vllm.platforms, "_current_platform", CpuPlatform())
    capability = [HOPPER]

    def device_capability(cls: type, device_id: int = 0) -> DeviceCapability:
        return capability[0]

    platform_cls = type(vllm.platforms.current_platform)
    mp.setattr(platform_cls, "get_device_capability", classmethod(device_capability))

    import vllm.v1.attention.backends.hpc_attn as hpc_attn

    mp.setattr(hpc_attn, "has_hpc_kernels", lambda: True)

    from tests.v1.attention import test_attention_backends as harness
    from vllm.v1.attention.backend import AttentionType

    hpc = harness.AttentionBackendEnum.HPC_ATTN
    triton = harness.AttentionBackendEnum.TRITON_ATTN
    lists = (
        "BACKENDS_TO_TEST",
        "SLIDING_WINDOW_BACKENDS_TO_TEST",
        "SLIDING_WINDOW_ENCODER_BACKENDS_TO_TEST",
        "NON_CAUSAL_BACKENDS_TO_TEST",
    )
    found: dict[str, Any] = {
        "lists": {name: hpc in getattr(harness, name) for name in lists}
    }

    def config(name: str) -> VllmConfig:
        vllm_config = harness.create_vllm_config(
            model_name=name, max_model_len=1024, block_size=16, num_gpu_blocks=64
        )
        vllm_config.cache_config.cache_dtype = "auto"
        return vllm_config

    qwen3, gqa32 = config(model), config(gqa32_model)
    cases = {
        "hopper-causal": (HOPPER, hpc, qwen3, AttentionType.DECODER, True),
        "hopper-non-causal": (HOPPER, hpc, qwen3, AttentionType.DECODER, False),
        "hopper-encoder": (HOPPER, hpc, qwen3, AttentionType.ENCODER_ONLY, False),
        "hopper-gqa32": (HOPPER, hpc, gqa32, AttentionType.DECODER, True),
        "ampere-causal": (AMPERE, hpc, qwen3, AttentionType.DECODER, True),
        "ampere-triton-encoder": (
            AMPERE,
            triton,
            qwen3,
            AttentionType.ENCODER_ONLY,
            False,
        ),
    }
    found["refusals"] = {}
    for case, (device, backend, vllm_config, attn_type, causal) in cases.items():
        capability[0] = device
        found["refusals"][case] = harness._selection_refusals(
            backend, vllm_config, attn_type, causal, False
        )

    def causal_mask(
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
        *,
        context_len: int,
    ) -> torch.Tensor:
        return (q_idx + context_len) >= kv_idx

    capability[0] = AMPERE
    found["skip"] = None
    with set_current_vllm_config(VllmConfig()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            harness._test_backend_correctness(
                harness.BATCH_SPECS["small_decode"], model, [hpc], causal_mask
            )
        except pytest.skip.Exception as e:
            found["skip"] = str(e)
    return found


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
