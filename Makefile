# mtp developer targets. Each target creates .venv first when it is missing
# (tools/venv_mode.py decides how):
#   CPU machine : a plain venv, torch==2.13.0 (the CPU build on local disk) installed first,
#                 then triton and the package with its test extras.
#   GPU machine : (nvidia-smi works) a venv on top of the system Python, which already has a
#                 CUDA torch and triton; nothing replaces them. Where python3 is itself a venv
#                 (the lent GPU machines), that interpreter is used as it is, with the checkout
#                 on PYTHONPATH: a venv made from it would not see its torch.
PYTHON ?= python3
VENV   ?= .venv
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
VENV_MODE := $(shell $(PYTHON) tools/venv_mode.py $(if $(HAS_GPU),--gpu) 2>/dev/null || echo create)
ifeq ($(VENV_MODE),reuse)
PY     := $(shell $(PYTHON) -c 'import sys; print(sys.executable)')
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
else
PY     := $(VENV)/bin/python
endif
PIP    := $(PY) -m pip
PYTEST_ARGS ?=
# Two workers when pytest-xdist is there (the CI machine has 2 cores).
XDIST = $$($(PY) -c "import xdist" 2>/dev/null && echo "-n 2")

# nvcc present -> `make test` first builds the CUTLASS extension (csrc/) for sm_90a and sm_100a:
# the compile check (tests/test_cutlass_build.py then reads its SASS). MTP_SKIP_CUDA_EXT=1 skips.
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_EXT := $(if $(NVCC),$(if $(filter 1,$(MTP_SKIP_CUDA_EXT)),,cuda-ext))
CUDA_EXT_DEPS := 'nvidia-cutlass==4.2.*' 'pybind11>=2.12' ninja nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm

.PHONY: venv test test-slow test-gpu clean cuda-ext gpu-bundle gpu-check test-triton-min

# Peers of mtp.integrations tested here (tests/test_megatron_integration.py,
# tests/test_torchtitan_integration.py): they pin a CUDA torch of their own, so --no-deps keeps
# the CPU torch; PEER_NEEDS are the pure-Python modules that importing torchtitan's MoE needs
# (its other requirements: data loading, logging, are not imported by the tests). PEER_NEEDS go
# in first, with their dependencies: pip's check after an install reports the unmet
# requirements of every installed package that depends on what it installed, so installing
# them after torchtitan would print an ERROR about torchtitan's pins (spmd_types, torchdata,
# wandb...); the peers then go in with --no-deps, which skips that check.
PEER_NODEPS := 'megatron-core==0.16.1' 'torchtitan==0.3.0' 'spmd-types==0.3.1'
PEER_NEEDS := 'tyro==1.0.17' 'einops==0.8.2'

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml
ifeq ($(VENV_MODE),reuse)
	mkdir -p $(VENV)
else ifeq ($(HAS_GPU),1)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PIP) install --no-deps --no-build-isolation -e .
	-$(PIP) install hypothesis pytest-xdist
else
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install triton numpy
	$(PIP) install -e ".[test]"
	$(PIP) install $(PEER_NEEDS)
	$(PIP) install --no-deps $(PEER_NODEPS)
endif
	touch $@

# The default suite: CPU-only, Triton interpreter, gloo process groups; `slow` and `gpu` skipped.
test: venv $(CUDA_EXT)
	$(if $(CUDA_EXT),MTP_REQUIRE_CUDA_EXT=1) $(PY) -m pytest $(XDIST) -q $(PYTEST_ARGS)

# The CUTLASS grouped GEMM extension mtp/_cuda_gemm*.so (ninja, incremental; MAX_JOBS nvcc
# processes, default 2 on a 2-core 24 GiB machine: one instantiation takes about 3.6 GiB).
cuda-ext: venv
	$(PIP) install -q --no-deps $(CUDA_EXT_DEPS)
	nice -n 10 $(PY) csrc/build_ext.py --inplace

# Heavy cases as well (e.g. nvcc builds of csrc/).
test-slow: venv $(CUDA_EXT)
	$(if $(CUDA_EXT),MTP_REQUIRE_CUDA_EXT=1) $(PY) -m pytest $(XDIST) -q --runslow $(PYTEST_ARGS)

# On a GPU machine: the tests that need CUDA.
test-gpu: venv
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

# The README's main job: the microbenchmarks (bench/, `mtp-bench`) into
# bench/results/local/<device>/, which git ignores. On a GPU: timings of every backend and peer;
# on a CPU-only machine: the smoke check and the structural figures (no timings).
# BENCH_ARGS="" runs the full set of shapes. `make bench-refresh` writes the committed results,
# bench/results/<device>/, instead (then commit them).
BENCH_ARGS ?= --quick

.PHONY: bench bench-refresh
bench: $(VENV)/.bench-installed
	$(PY) -m bench $(BENCH_ARGS) --out bench/results/local

bench-refresh: $(VENV)/.bench-installed
	$(PY) -m bench $(BENCH_ARGS) --out bench/results

# Plot and progress-bar packages (the `bench` extra). The GPU machine's Python already has
# matplotlib and no network; the CLI works without tqdm there.
$(VENV)/.bench-installed: $(VENV)/.installed
ifneq ($(HAS_GPU),1)
	$(PIP) install -e ".[bench]"
endif
	touch $@

# --- GPU run kit (bench/README.md, "On a lent GPU") ------------------------------------------
# CPU side: .gpu/ = the CUTLASS headers csrc/ includes (from the pinned nvidia-cutlass) and
# fallback test wheels; prints the folder to carry and the command to run on the GPU machine.
GPU_BUNDLE ?= .gpu
gpu-bundle: venv
	$(PIP) install -q --no-deps 'nvidia-cutlass==4.2.*'
	$(PY) tools/gpu_bundle.py --out $(GPU_BUNDLE)

# GPU side (its system python3, no venv, no network): env record, CUTLASS build for this GPU,
# pytest -m gpu, mtp-bench --quick, summary table; < 9 min, into $$OUT or bench/results/<gpu>/.
# GPU_CHECK_ARGS=--dry-run walks the steps on any machine.
GPU_CHECK_ARGS ?=
gpu-check:
	$(PYTHON) tools/gpu_check.py --bundle $(GPU_BUNDLE) $(GPU_CHECK_ARGS)

# Every Triton kernel the AOT tests compile, compiled for sm_90a/sm_100a under the minimum triton
# (3.6, the GPU machines') in .venv-min/ (created on first use, ~2 min). .ci/run runs it.
# Strict: a kernel in kernels/ that no AOT test compiles fails the check.
test-triton-min:
	MTP_MIN_TRITON_STRICT=1 $(PYTHON) tools/triton_min_check.py

# A small GPT and its MoE variant trained end to end (tp=2 x dp=2, ep=2 for the MoE): TP layers,
# sequence parallel, the distributed optimizer and the vocab-parallel loss, under torchrun on
# CPU/gloo (NCCL on GPUs). Prints the falling loss and tokens/s, writes demo_loss*.png.
DEMO_NPROC ?= 4
DEMO_ARGS ?=
TORCHRUN = $(PY) -m torch.distributed.run --standalone --nproc-per-node $(DEMO_NPROC)

.PHONY: demo
demo: $(VENV)/.bench-installed
	OMP_NUM_THREADS=1 $(TORCHRUN) examples/demo_train.py --png demo_loss.png $(DEMO_ARGS)
	OMP_NUM_THREADS=1 $(TORCHRUN) examples/demo_train.py --moe --fused-loss --png demo_loss_moe.png $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .venv-min build *.egg-info .pytest_cache mtp/_cuda_gemm*.so demo_loss*.png
