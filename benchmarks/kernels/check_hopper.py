# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Exit non-zero with one line unless a Hopper (sm90) GPU is visible."""

import sys

import torch

if not torch.cuda.is_available():
    sys.exit("benchmarks need a Hopper GPU (sm90); no CUDA device is visible")
major, minor = torch.cuda.get_device_capability()
if (major, minor) != (9, 0):
    name = torch.cuda.get_device_name()
    sys.exit(f"benchmarks need a Hopper GPU (sm90); found {name} sm{major}{minor}")
