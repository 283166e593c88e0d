# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Builds the _hpc_C extension through CMake, as vLLM's setup.py does.

    python setup.py build_ext --inplace

configures CMakeLists.txt with the running interpreter's torch and places the
library at vllm/_hpc_C.abi3.so. The build directory (build/) is reused, so
rebuilds are incremental through ninja. Set MAX_JOBS to bound parallelism and
CUTLASS_DIR to use a CUTLASS checkout instead of the nvidia-cutlass package.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build_dir = ROOT / "build"
        if self.inplace:
            output_dir = ROOT / "vllm"
        else:
            output_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        configure = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DHPC_PYTHON={sys.executable}",
            f"-DHPC_OUTPUT_DIR={output_dir}",
        ]
        if os.environ.get("CUTLASS_DIR"):
            configure.append(f"-DCUTLASS_DIR={os.environ['CUTLASS_DIR']}")
        subprocess.check_call(configure)
        build = ["cmake", "--build", str(build_dir), "--target", "_hpc_C"]
        if os.environ.get("MAX_JOBS"):
            build += ["-j", os.environ["MAX_JOBS"]]
        subprocess.check_call(build)

    def get_ext_filename(self, ext_name: str) -> str:
        # Limited-API extension: one file for every Python 3 version.
        return os.path.join(*ext_name.split(".")) + ".abi3.so"


setup(
    name="vllm-hpc-patchset",
    version="0.1.0",
    description="HPC attention and MoE backends for vLLM on Hopper",
    ext_modules=[CMakeExtension("vllm._hpc_C")],
    cmdclass={"build_ext": CMakeBuild},
    packages=[],
)
