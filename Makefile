# Entry points (see README.md):
#   make test      fresh machine: venv, pinned install, build, stable-ABI
#                  audit, apply, test suite (vLLM 0.33.0 sources fetched
#                  for the PR-level tests unless VLLM_SDIST names them)
#   make bench     fresh machine with a Hopper GPU: same set-up, then benchmarks
#   make gpu-test  machine that already has torch + CUDA (no package index):
#                  build in place, GPU tests and benchmarks, installs nothing
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
JOBS ?= $(shell nproc)
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: test bench gpu-test venv build build-venv abi-check apply check lint clean

now = $$(date +%s)

test: venv
	@t0=$(now); $(MAKE) --no-print-directory build-venv; \
	  echo "[time] build: $$(( $(now) - t0 )) s"
	@$(MAKE) --no-print-directory abi-check apply check
	@t0=$(now); sdist=$${VLLM_SDIST:-$$($(VPY) tools/fetch_vllm_sdist.py)} || exit 1; \
	  VLLM_SDIST=$$sdist $(VPY) -m pytest tests tools/tests -q $(PYTEST_ARGS); rc=$$?; \
	  echo "[time] tests: $$(( $(now) - t0 )) s"; exit $$rc

bench:
	@nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | grep -q '^9\.0' || \
	  { echo "make bench needs a Hopper (sm90) GPU and none is visible"; exit 1; }
	@$(MAKE) --no-print-directory venv
	@$(VPY) benchmarks/kernels/check_hopper.py
	@$(MAKE) --no-print-directory build-venv apply
	$(VPY) benchmarks/kernels/benchmark_hpc_decode.py $(BENCH_ARGS)
	$(VPY) benchmarks/kernels/benchmark_hpc_prefill.py $(BENCH_ARGS)
	$(VPY) benchmarks/kernels/benchmark_rope_norm.py $(BENCH_ARGS)
	$(VPY) benchmarks/kernels/benchmark_hpc_moe.py $(BENCH_ARGS)
	$(VPY) benchmarks/render_results.py

venv:
	@t0=$(now); \
	  test -x $(VPY) || $(PYTHON) -m venv $(VENV); \
	  $(VPY) -m pip install -q --upgrade pip && \
	  $(VPY) -m pip install -q -r requirements/test.txt && \
	  echo "[time] install: $$(( $(now) - t0 )) s"

build-venv:
	@PATH="$(abspath $(VENV))/bin:$$PATH" $(MAKE) --no-print-directory build PYTHON=$(abspath $(VPY))

# Configure once, then ninja rebuilds only what changed.
build:
	cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DHPC_PYTHON=$(PYTHON)
	cmake --build build -j $(JOBS)

# Fails unless vllm/_hpc_C.abi3.so uses torch's stable C ABI only, by the rule
# of vLLM's CI (torch-abi-audit, from requirements/test.txt).
abi-check:
	$(VPY) tools/check_torch_abi.py

apply:
	$(VPY) tools/apply_patchset.py

check:
	$(VPY) tools/apply_patchset.py --check

gpu-test:
	$(MAKE) --no-print-directory build
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest tests/kernels/hpc -q -m gpu $(PYTEST_ARGS)
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/kernels/benchmark_hpc_decode.py $(BENCH_ARGS)
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/kernels/benchmark_hpc_prefill.py $(BENCH_ARGS)
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/kernels/benchmark_rope_norm.py $(BENCH_ARGS)
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/kernels/benchmark_hpc_moe.py $(BENCH_ARGS)
	$(PYTHON) benchmarks/render_results.py

lint:
	$(VPY) -m ruff check . && $(VPY) -m ruff format --check .
	clang-format --dry-run -Werror $$(git ls-files 'csrc/*.cu' 'csrc/*.cuh' 'csrc/*.cpp' 'csrc/*.h')

clean:
	rm -rf build vllm/_hpc_C*.so
