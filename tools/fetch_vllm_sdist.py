# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fetch vLLM 0.33.0's source distribution from PyPI and print its path.

The PR-level tests (``tools/tests``: the patch set and its ``--diff`` on
vLLM's sources, vLLM's pre-commit checks on the PR's files) run against it
when ``VLLM_SDIST`` names it; ``make test`` sets that from this script.
The archive is checked against its published sha256 and kept, so a second
run only checks it. (``pip download`` cannot be used: it would build the
package's metadata, which needs vLLM's build requirements.)

usage: python tools/fetch_vllm_sdist.py [DIR]   (default: build/vllm-sdist)
"""

from __future__ import annotations

import hashlib
import json
import sys
import urllib.request
from pathlib import Path

from apply_patchset import BASE_VERSION

FILENAME = f"vllm-{BASE_VERSION}.tar.gz"
# The published digest of that archive (PyPI); a new base version needs its own.
SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
INDEX = "https://pypi.org/simple/vllm/"
DEFAULT_DIR = Path(__file__).resolve().parents[1] / "build" / "vllm-sdist"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def archive_url() -> str:
    """The archive's URL, from the index's JSON listing (PEP 691)."""
    request = urllib.request.Request(
        INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        listing = json.load(response)
    for entry in listing["files"]:
        if entry["filename"] == FILENAME:
            return entry["url"]
    raise SystemExit(f"fetch_vllm_sdist: {INDEX} lists no {FILENAME}")


def fetch(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILENAME
    if path.is_file() and sha256_of(path) == SHA256:
        return path
    partial = path.with_suffix(".part")
    with (
        urllib.request.urlopen(archive_url(), timeout=600) as response,
        partial.open("wb") as out,
    ):
        while chunk := response.read(1 << 20):
            out.write(chunk)
    got = sha256_of(partial)
    if got != SHA256:
        partial.unlink()
        raise SystemExit(f"fetch_vllm_sdist: {FILENAME} has sha256 {got}, not {SHA256}")
    partial.replace(path)
    return path


def main(argv: list[str]) -> int:
    directory = Path(argv[1]) if len(argv) > 1 else DEFAULT_DIR
    print(fetch(directory))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
