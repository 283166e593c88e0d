# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of the decode calibration script: its cases and byte
accounting (equal to the decode benchmark's floors), the cache layouts it
builds, the read kernel (in Triton's interpreter) and its options (the
timings need an H200)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNELS = REPO_ROOT / "benchmarks" / "kernels"
sys.path.insert(0, str(KERNELS))
pytest.importorskip("triton")
import benchmark_hpc_decode as decode  # noqa: E402
import calibrate_decode as cal  # noqa: E402


def test_case_names():
    names = [c.name for c in cal.cal_cases()]
    assert len(names) == len(set(names)) == 16
    assert "tp8-bf16-w1-packed" in names
    assert "tp1-fp8-b256x32768-separate" in names
    for name in names:
        tp, cache, shape, layout = name.split("-")
        assert tp in decode.HEAD_CONFIGS and cache in ("bf16", "fp8")
        assert shape in cal.SHAPES and layout in cal.LAYOUTS
    assert cal.EMPTY_CASES == {"empty-graph": 1, "empty-graph-x64": 64}
    empty, cases = cal.select(["empty-*", "tp8-*-w1-*"])
    assert empty == ["empty-graph", "empty-graph-x64"]
    assert sorted(c.name for c in cases) == [
        "tp8-bf16-w1-packed",
        "tp8-bf16-w1-separate",
        "tp8-fp8-w1-packed",
        "tp8-fp8-w1-separate",
    ]


def test_bytes_are_the_decode_floor_bytes():
    by_name = {c.name: c for c in cal.cal_cases()}
    w1 = {c.name: c for c in decode.w1_cases()}
    for tp in ("tp1", "tp8"):
        for cache in ("bf16", "fp8"):
            floor = w1[f"{tp}-{cache}"].floor_bytes()
            for layout in cal.LAYOUTS:
                assert by_name[f"{tp}-{cache}-w1-{layout}"].kv_bytes == floor
    assert by_name["tp8-bf16-w1-packed"].kv_bytes == 132_120_576
    # 256 x 32768 tokens x 8 KV heads x 128 x (K and V) x 2 bytes.
    assert by_name["tp1-bf16-b256x32768-packed"].kv_bytes == 34_359_738_368
    b256 = decode.Case("W2", "tp1", True, (32768,) * 256, 1)
    assert by_name["tp1-fp8-b256x32768-separate"].kv_bytes == b256.floor_bytes()


def test_tiles_cover_the_bytes_once():
    for c in cal.cal_cases():
        dcase = c.decode_case
        tile_bytes = decode.BLOCK_SIZE * c.words * cal.INT32_BYTES
        assert c.num_tiles * 2 * tile_bytes == c.kv_bytes
        assert c.words == (64 if not c.fp8 else 32)
        assert c.num_tiles == dcase.num_blocks * dcase.heads[1]


@pytest.mark.parametrize("layout", cal.LAYOUTS)
@pytest.mark.parametrize("fp8", [False, True])
def test_cal_set_layouts(monkeypatch: pytest.MonkeyPatch, layout: str, fp8: bool):
    monkeypatch.setitem(cal.SHAPES, "tiny", (128, 64, 192))
    case = cal.CalCase("tp1", fp8, "tiny", layout)
    s = cal.make_cal_set(case, seed=0, device="cpu")
    assert sum(b.numel() * b.element_size() for b in s.buffers) == case.kv_bytes
    assert len(s.buffers) == (1 if layout == "packed" else 2)
    dcase = case.decode_case
    assert s.k_words.shape == (dcase.num_blocks, 8, 64, case.words)
    assert s.k_words.stride() == s.v_words.stride()
    token_stride = 2 * case.words if layout == "packed" else case.words
    assert s.k_words.stride(2) == token_stride
    # The decode kernel's views of the same memory.
    assert s.key_cache.shape == (dcase.num_blocks, 64, 8, 128)
    assert s.key_cache.data_ptr() == s.k_words.data_ptr()
    assert s.value_cache.data_ptr() == s.v_words.data_ptr()
    k = s.key_cache[3, 5, 2].view(torch.int32)
    assert torch.equal(k, s.k_words[3, 2, 5])


def test_page_order_follows_the_block_table(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(cal.SHAPES, "tiny", (128, 64, 192))
    dcase = cal.CalCase("tp8", False, "tiny", "packed").decode_case
    layout = decode.make_layout(dcase, device="cpu")
    pages = cal.page_order(layout, dcase)
    table = layout.block_table
    assert pages.tolist() == table[0, :2].tolist() + table[1, :1].tolist() + (
        table[2, :3].tolist()
    )
    assert sorted(pages.tolist()) == list(range(dcase.num_blocks))


def test_reference_sums_see_every_word():
    k = torch.randint(-(2**31), 2**31 - 1, (2, 1, 4, 8), dtype=torch.int32)
    v = torch.randint(-(2**31), 2**31 - 1, (2, 1, 4, 8), dtype=torch.int32)
    pages = torch.tensor([1, 0], dtype=torch.int32)
    before = cal.reference_sums(k, v, pages, [0, 1])
    v[0, 0, 3, 7] ^= 1
    after = cal.reference_sums(k, v, pages, [0, 1])
    # Tile 1 reads page 0, tile 0 page 1.
    assert after[0] == before[0] and after[1] != before[1]


def test_read_kernel_in_the_interpreter():
    """The Triton read kernel, run by Triton's CPU interpreter, writes the
    XOR of each tile's K and V words for both layouts and dtypes."""
    # Without a GPU driver vLLM's triton_utils hands out stand-ins; the
    # interpreter needs the real modules, set before the script imports them.
    script = textwrap.dedent(
        """
        import torch
        import triton
        import triton.language as tl
        import vllm.triton_utils

        vllm.triton_utils.triton, vllm.triton_utils.tl = triton, tl
        import benchmark_hpc_decode as decode
        import calibrate_decode as cal

        cal.SHAPES["tiny"] = (128, 64)
        for tp in ("tp1", "tp8"):
            for fp8 in (False, True):
                for layout in cal.LAYOUTS:
                    case = cal.CalCase(tp, fp8, "tiny", layout)
                    s = cal.make_cal_set(case, seed=0, device="cpu")
                    dcase = case.decode_case
                    pages = cal.page_order(
                        decode.make_layout(dcase, device="cpu"), dcase
                    )
                    sums = torch.zeros(case.num_tiles, dtype=torch.int32)
                    cal.launch_read(s.k_words, s.v_words, pages, sums)
                    tiles = list(range(case.num_tiles))
                    want = cal.reference_sums(s.k_words, s.v_words, pages, tiles)
                    assert [int(x) for x in sums] == want, case.name
                    assert len(set(want)) > 1, case.name
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=KERNELS,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_choose_num_sets_leaves_room_for_the_copy():
    case = next(c for c in cal.cal_cases() if c.name == "tp1-bf16-b256x32768-packed")
    size = case.set_bytes()
    assert cal.choose_num_sets(case, 3 * size) == 2
    assert cal.choose_num_sets(case, 2 * size) == 1
    assert cal.choose_num_sets(case, 2 * size - 1) == 0
    small = next(c for c in cal.cal_cases() if c.name == "tp8-fp8-w1-separate")
    assert cal.choose_num_sets(small, 10**12) == 4


def test_list_needs_no_gpu(capsys: pytest.CaptureFixture[str]):
    assert cal.main(["--list", "--cases", "empty-graph,tp8-bf16-w1-*"]) == 0
    out = capsys.readouterr().out
    assert "tp8-bf16-w1-packed" in out and "tp8-bf16-w1-separate" in out
    assert "132.1" in out  # MB of K and V
    assert "1 empty-graph cases, 2 stream cases" in out


def test_parse_args_rejects_few_iters():
    with pytest.raises(SystemExit):
        cal.parse_args(["--iters", "10"])
    assert cal.parse_args([]).iters >= cal.MIN_ITERS
