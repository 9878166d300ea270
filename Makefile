# elastic_emb: the README's two commands are `make demo` and `make test`.
# `make check` is the fast tier to run before each commit; `make lint` runs ruff.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# every run lists its 30 slowest tests (CI logs show where the time goes)
PYTEST_ARGS ?=
# the whole suite in two workers, a file per worker at a time: most tests wait on agents, heartbeats
# and timeouts, so two workers fill the two cores of a small machine
PYTEST_WORKERS ?= -n 2 --dist loadfile

.PHONY: demo test check compat venv bench clean lint format image-check system-deps

venv: $(VENV)/.installed

# torch first, a CPU build (scripts/install-torch.sh: a local wheel from pip's configuration, else
# TORCH_INDEX, default PyTorch's CPU index); then the package with the extras the suite exercises and
# the PEP 735 groups test and lint (pip >= 25.1 for --group).
$(VENV)/.installed: pyproject.toml scripts/install-torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade 'pip>=25.1'
	TORCH_SPEC='$(TORCH_SPEC)' TORCH_INDEX='$(TORCH_INDEX)' scripts/install-torch.sh $(PY)
	$(PY) -m pip install -q -e '.[drill,metrics,etcd-v2]' --group test --group lint
	touch $@

# The optional TorchRec extra for its tests: torchrec with --no-deps (its metadata wants the CUDA
# fbgemm-gpu), everything pinned to the torch already installed so nothing replaces it.
TORCHREC_SPEC ?= torchrec==1.8.0
$(VENV)/.torchrec: $(VENV)/.installed
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e '.[torchrec]' --group torchrec-cpu
	$(PY) -m pip install -q --no-deps -c $(VENV)/torch-constraint.txt "$(TORCHREC_SPEC)"
	touch $@

demo: venv
	$(VENV)/bin/elastic-emb demo

# The system packages the suite needs (.ci/apt-packages): installed when run as root, else
# `make test` stops with the command to run. SKIP_SYSTEM_DEPS=1 runs anyway (their tests skip,
# listed at the end; under CI=true a skip fails).
system-deps:
	@if [ -z "$(SKIP_SYSTEM_DEPS)" ]; then PYTHON="$(PYTHON)" .ci/system-deps; fi

test: system-deps venv $(VENV)/.torchrec
	$(PY) -m pytest $(PYTEST_WORKERS) --durations=30 $(PYTEST_ARGS)

# The fast tier: no torchrun agents, no etcd, no drills (a test that starts one fails and says to
# mark it slow). Needs no system packages beyond a compiler for the native example.
check: venv $(VENV)/.torchrec
	$(PY) -m pytest -m "not slow and not gpu" --fast-tier --durations=10 $(PYTEST_ARGS)

# Another torch (CI: 2.14.1): the fast tier and one drill, in a venv of its own. The TorchRec adapter
# is verified with the torch of `make test` only (its fbgemm build matches that torch).
COMPAT_TORCH ?= torch==2.14.1
COMPAT_VENV ?= .venv-compat
COMPAT_INDEX ?= pip
# torch 2.14.1 from CI's mirror is a CUDA build (about 6 GiB in the venv): a disk too full for it stops
# the target at once, saying how much is free, instead of pip failing halfway with ENOSPC.
COMPAT_DISK_GIB ?= 7
compat:
	@test -f $(COMPAT_VENV)/.installed || $(PYTHON) scripts/check-disk.py $(COMPAT_DISK_GIB) "$(COMPAT_TORCH) in $(COMPAT_VENV)"
	$(MAKE) venv VENV=$(COMPAT_VENV) TORCH_SPEC='$(COMPAT_TORCH)' TORCH_INDEX='$(COMPAT_INDEX)'
	$(COMPAT_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -m "not slow and not gpu" --fast-tier --ignore tests/test_adapters_torchrec.py \
		-n 2 --dist loadfile $(PYTEST_ARGS)
	$(COMPAT_VENV)/bin/python -m pytest tests/test_drill.py -k "loses_nothing and scale-down" $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Every benchmark once at its smallest size on the CPU (what the suite's smoke test runs); the
# figures in BENCHMARKS.md come from the commands listed there.
bench: venv
	$(PY) -m pytest -q tests/test_benches.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

# Build the CPU image with buildah from local stand-ins (debootstrap base, local torch wheel, uv from
# PyPI) and run the demo in it as uid 10001 on a read-only root (root; ~5 min; not part of `test`).
image-check:
	bash scripts/image-check.sh
