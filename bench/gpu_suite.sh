#!/usr/bin/env bash
# The GPU suite: everything elastic_emb measures on NCCL, in one call on the 2-GPU machine.
#
#   bench/gpu_suite.sh [STEP ...]      STEP in: env tests unit lifecycle lookup reshard teardown nccl drill fast
#                                      (default: all but lifecycle, which tests includes), or on ONE GPU:
#                                      onegpu (tests/test_context_cuda.py, tests/test_commit_cuda.py, tests/test_capture_failure.py + the gather test) and lookup1
#                                      (bench/lookup.py --device cuda --ranks 1)
#
# Run from the repository root on the device machine, with the wheels of the packages its image
# lacks carried in .whl/ (pydantic, pydantic-core, annotated-types, typing-inspection,
# typing-extensions, structlog, and setuptools >= 77, which builds the package's PEP 639 metadata). Writes one JSON per benchmark and a log to
# $OUT (or out/gpu), and prints a short table at the end. Never changes GPU settings; keeps
# NVLink multicast off.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ELASTIC_EMB_LOG_LEVEL=${ELASTIC_EMB_LOG_LEVEL:-warning}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
steps=${*:-env tests lookup reshard teardown drill}
PY=${PY:-python3}

if [ -d .whl ]; then
    # Install the carried wheels and elastic_emb itself (its metadata carries the torchrun.handlers
    # entry point, so `torchrun --rdzv-backend=elastic_emb` finds the backend).
    rm -rf /tmp/site && mkdir -p /tmp/site
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site  # before the build: it needs the carried setuptools
    $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . || exit 1
fi

run() {  # run NAME TIMEOUT CMD...: bounded, logged, never stops the suite
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*" | tee -a "$OUT/suite.log"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$OUT/suite.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/suite.log"
}

for step in $steps; do
    case $step in
    env) run env 60 bash -c "nvidia-smi -L; $PY -c 'import torch,sys; print(sys.version); print(torch.__version__, torch.cuda.nccl.version(), torch.cuda.device_count(), torch.cuda.get_device_name(0))'" ;;
    tests) run tests 420 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_context_nccl.py tests/test_lifecycle.py tests/test_drill.py ;;
    unit) run unit 200 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_context_nccl.py tests/test_lifecycle.py ;;
    lookup) run lookup 240 $PY bench/lookup.py --device cuda --runs 5 --chunks 3 2 4 --out "$OUT/lookup.json" ;;
    reshard) run reshard 400 $PY bench/reshard.py --device cuda --world 2 --sizes-mb 8192 --runs 3 --out "$OUT/reshard.json" ;;
    teardown) run teardown 400 $PY bench/teardown.py --runs 2 --out "$OUT/teardown.json" ;;
    nccl) run nccl 300 $PY bench/nccl_setup.py --out "$OUT/nccl_setup.json" ;;
    drill) run drill 420 $PY -m elastic_emb.cli.main drill --scenario gpu-2-1-2 --out "$OUT/drill" ;;
    lifecycle) run lifecycle 200 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_lifecycle.py ;;
    onegpu) run onegpu 300 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_context_cuda.py tests/test_commit_cuda.py tests/test_capture_failure.py "tests/test_context.py::test_gather_rows_reads_each_row_from_its_source" ;;
    fast) run fast 400 $PY -m pytest -q -p no:cacheprovider -n 8 -m "not slow and not gpu" --fast-tier ;;
    lookup1) run lookup1 300 $PY bench/lookup.py --device cuda --ranks 1 --runs 7 --iters 10 --out "$OUT/lookup_1gpu.json" ;;
    *) echo "unknown step $step (use: env tests unit lifecycle lookup reshard teardown nccl drill fast onegpu lookup1)"; exit 2 ;;
    esac
done
grep -E '^(=== |ranks|table|scenario|healthy|broken|destroy|live|snapshot|dcp|lookup|gather|all_to_all|PASS|FAIL|zero)' "$OUT/suite.log" | tail -80
