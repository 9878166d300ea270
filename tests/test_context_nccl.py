"""EmbContext on NCCL: the essentials of tests/test_context.py, one GPU per rank.

Needs torch.cuda.device_count() >= 2; otherwise every test here is skipped with the reason. Runs
tests/context_worker.py in real processes (spawned here, one per GPU, ELASTIC_EMB_BACKEND=nccl):
a 2-rank world (lookups and gradients exactly equal to single-process nn.Embedding + SGD and
row-wise Adagrad, invalid ids, reset rules and rank remap, close, DCP save, re-construction on
1 GPU with the rows imported), then a 1-rank world that loads the 2-rank DCP checkpoint.

On the GPU machine:  python -m pytest tests/test_context_nccl.py -q
The worker also runs under torchrun directly, e.g.
    CTX_TEST_CFG='{"dir": "/tmp/ctx", "tag": "tr", "load_from": null, "shrink_to": null}' \\
    ELASTIC_EMB_BACKEND=nccl torchrun --nproc-per-node 2 tests/context_worker.py
(the last line each rank prints is its JSON verdict per check).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import SOURCE_ROOT as REPO
from elastic_emb.testing.procs import run_ranks, torchrun_env

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        GPUS < 2,
        reason=f"NCCL tests need >= 2 CUDA devices; this machine has {GPUS} "
        f"(torch {torch.__version__}, cuda available: {torch.cuda.is_available()})",
    ),
]

WORKER = os.path.join(REPO, "tests", "helpers", "context_worker.py")
RUNS = [("n2", 2, 2, None, 1), ("n1", 1, 1, "n2", None)]
CHECKS = [
    "sgd_matches_reference",
    "large_batches",
    "adagrad_matches_reference",
    "invalid_ids",
    "mismatched_calls",
    "reset_rules",
    "reset_same_world",
    "reset_new_rank_mapping",
    "close_and_use_after_close",
    "init_rows_independent_of_world",
    "dcp",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    shared = tmp_path_factory.mktemp("ctx_nccl")
    cache = {}
    for tag, world, ep, load_from, shrink in RUNS:
        cfg = {"dir": str(shared), "tag": tag, "load_from": load_from, "shrink_to": shrink}
        port = free_port()
        envs = [
            torchrun_env(
                r,
                world,
                port,
                run_id=f"nccl-{tag}",
                extra={
                    "ELASTIC_EMB_EP_SIZE": str(ep),
                    "ELASTIC_EMB_BACKEND": "nccl",
                    "NCCL_NVLS_ENABLE": "0",
                    "CTX_TEST_CFG": json.dumps(cfg),
                },
            )
            for r in range(world)
        ]
        code = f"import runpy, sys; sys.argv = [{WORKER!r}]; runpy.run_path({WORKER!r}, run_name='__main__')"
        cache[tag] = run_ranks(code, envs, timeout=240)
    return cache


CASES = [(t, c) for t, *_ in RUNS for c in CHECKS] + [("n2", "reconstruct_at_other_world_size")]


@pytest.mark.parametrize("tag,check", CASES, ids=[f"{t}-{c}" for t, c in CASES])
def test_context_nccl(runs, tag, check):
    for r in runs[tag]:
        assert r.returncode == 0, f"{tag} rank {r.rank} exited {r.returncode}:\n{r.stderr[-4000:]}"
        res = r.value
        assert check in res, f"{tag} rank {r.rank} did not run {check}; ran {sorted(res)}"
        assert res[check]["ok"], f"{tag} rank {r.rank} {check}: {res[check].get('error')}\n{res[check].get('tb', '')}"
        assert res["arena"]["device"].startswith("cuda"), res["arena"]
    if check == "large_batches" and tag == "n2":
        # the long batches went through the captured dedup graphs, not the eager fallback
        assert all(
            r.value["large_batches"]["graphs"] > 0 and not r.value["large_batches"]["capture_failed"] for r in runs[tag]
        ), [r.value["large_batches"] for r in runs[tag]]
    if check == "dcp" and tag == "n1":
        assert runs[tag][0].value["dcp"]["loaded_from"] == "n2"
