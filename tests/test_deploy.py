"""The Kubernetes templates, the Dockerfile and the preStop drain, checked offline.

Every manifest of deploy/ is rendered with ``kubectl kustomize`` (as shipped, with components,
and under a ``namePrefix``) and must pass: strict core schemas for every supported Kubernetes
version and the fields usable in the minimum one, our PyTorchJob and PodMonitor schemas plus the
training operator's admission rules, and the wiring rules of tests/helpers/deploy_rules.py. Each
rule has a planted error that must make it fail. The drain hook and a worker's metrics endpoint
are run for real.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from elastic_emb.testing.ports import free_port
from tests.helpers import deploy_rules as R
from tests.helpers.etcd_fixture import etcd_server  # noqa: F401  (the fixture, for the etcd-v2 drain)

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _need_kubectl() -> None:
    if R.kubectl() is None:
        if CI:
            pytest.fail(
                "kubectl is not installed in CI: it is part of this machine kind's image (kubectl bundles "
                "kustomize); install it so deploy/ can be rendered"
            )
        pytest.skip("kubectl (which bundles kustomize) is not installed here; CI has it")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Every overlay, the variants a user makes with deploy/components ("overlay+component"), and
    each of them under a namePrefix of a user's kustomization ("team-a-/overlay+component")."""
    _need_kubectl()
    out = {o: R.render(o) for o in R.OVERLAYS}
    work = tmp_path_factory.mktemp("variants")
    for key in VARIANTS:
        overlay, *components = key.split("+")
        out[key] = R.render_variant(work, overlay, tuple(components))
    for key in R.OVERLAYS + VARIANTS:
        overlay, *components = key.split("+")
        out[PREFIX + "/" + key] = R.render_variant(work, overlay, tuple(components), PREFIX)
    return out


PREFIX = "team-a-"
VARIANTS = (
    "indexed-job+cpu",
    "pytorchjob-etcd+cpu",
    "indexed-job-etcd+etcd-v2",
    "pytorchjob-etcd+etcd-v2",
    "indexed-job+no-endport",
    "pytorchjob-etcd+no-endport",
    "indexed-job+metrics",
    "pytorchjob+metrics",
    "indexed-job-etcd+metrics+cpu",
)
ALL = R.OVERLAYS + VARIANTS + tuple(PREFIX + "/" + k for k in R.OVERLAYS + VARIANTS)


def pick(resources: list[dict], kind: str) -> dict:
    (res,) = R.of_kind(resources, kind)
    return res


def container(pod_template: dict) -> dict:
    return R._container(pod_template)


def pod_template(resources: list[dict]) -> dict:
    return R.workload(resources).pod_template


def env_set(c: dict, key: str, value: str) -> None:
    for e in c["env"]:
        if e["name"] == key:
            e.clear()
            e.update(name=key, value=value)
            return
    c["env"].append({"name": key, "value": value})


# -- rendering and the one place for parameters -----------------------------------------------


def test_every_overlay_renders_the_expected_kinds(rendered):
    kinds = {o: sorted(r["kind"] for r in res) for o, res in rendered.items()}
    assert kinds["pytorchjob"] == ["NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "PyTorchJob"]
    assert kinds["indexed-job"] == ["Job", "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "Service"]
    store = ["NetworkPolicy", "PodDisruptionBudget", "Service", "Service", "StatefulSet"]  # client + peer Service
    assert kinds["pytorchjob-etcd"] == sorted(kinds["pytorchjob"] + store)
    assert kinds["indexed-job-etcd"] == sorted(kinds["indexed-job"] + store)
    assert [R.workload(rendered[o]).inner for o in R.OVERLAYS] == ["c10d", "c10d", "etcd-v3", "etcd-v3"]
    assert [R.workload(rendered[v]).inner for v in VARIANTS if v.endswith("+etcd-v2")] == ["etcd-v2", "etcd-v2"]
    for res in rendered.values():  # the params object is local config: it never reaches the cluster
        assert not R.of_kind(res, "DeployParams")


def test_components_do_what_they_say(rendered):
    """cpu: no GPU asked, gloo; no-endport: every TCP port among the job's pods, same peers;
    etcd-v2: torch's etcd-v2 on a store with the v2 API."""
    for v in ("indexed-job+cpu", "pytorchjob-etcd+cpu"):
        c = container(pod_template(rendered[v]))
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {}) and "nvidia.com/gpu" not in c["resources"].get(
            "requests", {}
        )
        assert {"name": "ELASTIC_EMB_BACKEND", "value": "gloo"} in c["env"]
    for v in ("indexed-job+no-endport", "pytorchjob-etcd+no-endport"):
        spec = _np(rendered[v])
        assert spec["ingress"][0]["ports"] == [{"protocol": "TCP"}] == spec["egress"][0]["ports"]
        assert spec["ingress"][0]["from"] == _np(rendered[v.split("+")[0]])["ingress"][0]["from"]
    for v in ("indexed-job-etcd+etcd-v2", "pytorchjob-etcd+etcd-v2"):
        etcd = pick(rendered[v], "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
        assert "--enable-v2=true" in etcd["command"] and R.etcd_image_version(etcd["image"]) == (3, 5)
    for v in ("indexed-job-etcd", "pytorchjob-etcd"):  # the v3 path runs etcd 3.6
        etcd = pick(rendered[v], "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
        assert R.etcd_image_version(etcd["image"]) == (3, 6) and "--enable-v2=true" not in etcd["command"]
    # metrics: off in the overlays; the component turns them on, declares a port per process and
    # adds the PodMonitor and the scraper's ingress rule.
    for o in R.OVERLAYS:
        assert R.metrics_ports(R.workload(rendered[o])) == {} and not R.of_kind(rendered[o], "PodMonitor")
    for v in ("indexed-job+metrics", "pytorchjob+metrics"):
        w = R.workload(rendered[v])
        assert sorted(R.metrics_ports(w)) == list(range(9400, 9409))
        assert sorted(R.scraped_ports(rendered[v], w)) == list(range(9400, 9409))
        assert [p["name"] for p in container(w.pod_template)["ports"]][-9:] == ["metrics"] + [
            f"metrics-w{r}" for r in range(8)
        ]
        assert _np(rendered[v])["ingress"][-1]["ports"] == [{"protocol": "TCP", "port": 9400, "endPort": 9408}]


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_pass_the_schemas_and_the_rules(rendered, variant):
    assert R.core_schema_errors(rendered[variant], (R.K8S_MIN, R.K8S_VERSIONS[-1])) == []
    assert [e for pm in R.of_kind(rendered[variant], "PodMonitor") for e in R.podmonitor_schema_errors(pm)] == []
    assert R.wiring_errors(rendered[variant]) == []


def test_params_file_is_the_one_place(tmp_path):
    """Changing image, node range and GPUs in deploy/params/params.yaml changes every field that
    depends on them, in both workloads, with the right types."""
    _need_kubectl()
    tree = tmp_path / "deploy"
    shutil.copytree(R.DEPLOY, tree)
    params_file = tree / "params" / "params.yaml"
    params = yaml.safe_load(params_file.read_text())
    params["spec"].update(
        image="example.org/team/emb:9.9.9",
        minNodes=3,
        maxNodes=7,
        workersPerNode=2,
        portRangeStart=40000,
        portRangeEnd=40999,
        restartBudget=175,
        etcdCpu="2",
        etcdMemory="3Gi",
        etcdStorage="20Gi",
    )
    params_file.write_text(yaml.safe_dump(params))
    job = R.render(tree / "pytorchjob")
    pj = pick(job, "PyTorchJob")
    w = R.workload(job)
    c = container(w.pod_template)
    assert c["image"] == "example.org/team/emb:9.9.9"
    assert (pj["spec"]["elasticPolicy"]["minReplicas"], pj["spec"]["elasticPolicy"]["maxReplicas"]) == (3, 7)
    assert pj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 7
    assert pj["spec"]["nprocPerNode"] == "2" and c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pick(job, "PodDisruptionBudget")["spec"]["minAvailable"] == 3
    assert pj["spec"]["runPolicy"]["backoffLimit"] == 175
    ij = R.render(tree / "indexed-job")
    jb = pick(ij, "Job")
    c = container(jb["spec"]["template"])
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert c["image"] == "example.org/team/emb:9.9.9"
    assert (jb["spec"]["parallelism"], jb["spec"]["completions"]) == (7, 7)
    assert env["PET_NNODES"] == "3:7" and env["PET_NPROC_PER_NODE"] == "2"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pick(ij, "PodDisruptionBudget")["spec"]["minAvailable"] == 3
    assert jb["spec"]["backoffLimit"] == 175
    for res in (job, ij):  # the pods' worker count, for the scrape configuration (a string)
        assert R.workload(res).pod_meta["annotations"][R.WORKERS_ANNOTATION] == "2"
    # The etcd members' sizes.
    sts = pick(R.render(tree / "indexed-job-etcd"), "StatefulSet")["spec"]
    etcd = sts["template"]["spec"]["containers"][0]["resources"]
    assert etcd == {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "3Gi"}}
    assert sts["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "20Gi"
    for res in (job, ij):
        # The pods' ephemeral range and the NetworkPolicy's range both follow the parameters.
        assert R.port_range(R.workload(res)) == (40000, 40999)
        for rules in (_np(res)["ingress"], _np(res)["egress"]):
            assert {"protocol": "TCP", "port": 40000, "endPort": 40999} in rules[0]["ports"]
        assert R.core_schema_errors(res, ("1.31.0",)) == []
        assert R.wiring_errors(res) == []
    # The offline check notices a node range the restart budget does not cover.
    params["spec"].update(restartBudget=100)
    params_file.write_text(yaml.safe_dump(params))
    assert any("backoffLimit=100" in e for e in R.wiring_errors(R.render(tree / "indexed-job"), only="completion"))


# -- strict core schemas over the supported versions -------------------------------------------


@pytest.mark.parametrize("overlay", R.OVERLAYS)
def test_core_schemas_strict_on_every_supported_version(rendered, overlay):
    assert R.core_schema_errors(rendered[overlay]) == []


def test_core_schema_planted_errors_fail(rendered):
    res = copy.deepcopy(rendered["indexed-job"])
    pick(res, "Job")["spec"]["parallelism"] = "4"  # a string where an integer belongs
    errs = R.core_schema_errors(res, ("1.31.0",))
    assert any("parallelism" in e and "integer" in e for e in errs), errs
    res = copy.deepcopy(rendered["indexed-job"])
    pick(res, "Service")["spec"]["clusterIp"] = "None"  # misspelt field: strict mode rejects it
    errs = R.core_schema_errors(res, ("1.31.0",))
    assert any("clusterIp" in e for e in errs), errs
    res = copy.deepcopy(rendered["pytorchjob"])  # the PyTorchJob's pod template goes through PodTemplateSpec
    container(pod_template(res))["resources"]["limit"] = {"cpu": "1"}
    errs = R.core_schema_errors(res, ("1.31.0",))
    assert any("PodTemplate" in e and "limit" in e for e in errs), errs


# -- our PyTorchJob schema and the operator's admission rules ------------------------------------


def test_pytorchjob_schema_and_admission_clean(rendered):
    job = pick(rendered["pytorchjob"], "PyTorchJob")
    assert R.pytorchjob_schema_errors(job) == []
    assert R.admission_errors(job) == []


SCHEMA_PLANTS = {
    "unknown field": (lambda j: j["spec"]["elasticPolicy"].update(minReplica=1), "minReplica"),
    "wrong type": (lambda j: j["spec"]["elasticPolicy"].update(rdzvPort="29400"), "rdzvPort"),
    "bad enum": (lambda j: j["spec"]["runPolicy"].update(cleanPodPolicy="Sometimes"), "cleanPodPolicy"),
    "unknown replica type": (lambda j: j["spec"]["pytorchReplicaSpecs"].update(Chief={"template": {}}), "Chief"),
    "bad nprocPerNode": (lambda j: j["spec"].update(nprocPerNode="eight"), "nprocPerNode"),
}


@pytest.mark.parametrize("plant", sorted(SCHEMA_PLANTS))
def test_pytorchjob_schema_planted_error_fails(rendered, plant):
    job = copy.deepcopy(pick(rendered["pytorchjob"], "PyTorchJob"))
    mutate, needle = SCHEMA_PLANTS[plant]
    mutate(job)
    errs = R.pytorchjob_schema_errors(job)
    assert any(needle in e for e in errs), errs


def _worker(j: dict) -> dict:
    return j["spec"]["pytorchReplicaSpecs"]["Worker"]


ADMISSION_PLANTS = {
    "name not DNS-1035": (lambda j: j["metadata"].update(name="Elastic_Emb"), "DNS-1035"),
    "name starts with a digit": (lambda j: j["metadata"].update(name="1-emb"), "DNS-1035"),
    "no container named pytorch": (
        lambda j: container(_worker(j)["template"]).update(name="trainer"),
        "named 'pytorch'",
    ),
    "container without image": (lambda j: container(_worker(j)["template"]).update(image=""), "image must be set"),
    "replicas below min": (lambda j: _worker(j).update(replicas=1), ">= elasticPolicy.minReplicas"),
    "replicas above max": (lambda j: _worker(j).update(replicas=9), "<= elasticPolicy.maxReplicas"),
    "min above max": (lambda j: j["spec"]["elasticPolicy"].update(minReplicas=5), "minReplicas=5 must be <="),
    "elastic without Worker": (
        lambda j: j["spec"].update(pytorchReplicaSpecs={"Master": _worker(j) | {"replicas": 1}}),
        "Worker must be configured",
    ),
    "two Masters": (
        lambda j: j["spec"]["pytorchReplicaSpecs"].update(Master=_worker(j) | {"replicas": 2}),
        "Master.replicas must be 1",
    ),
    "both nproc settings": (lambda j: j["spec"]["elasticPolicy"].update(nProcPerNode=8), "nProcPerNode must not"),
}


@pytest.mark.parametrize("plant", sorted(ADMISSION_PLANTS))
def test_admission_planted_error_fails(rendered, plant):
    job = copy.deepcopy(pick(rendered["pytorchjob"], "PyTorchJob"))
    mutate, needle = ADMISSION_PLANTS[plant]
    mutate(job)
    errs = R.admission_errors(job)
    assert any(needle in e for e in errs), errs


@pytest.mark.slow
def test_own_schema_agrees_with_the_operator_api(rendered):
    """Our PyTorchJob schema and the rendered job against the operator's own API types (its SDK)."""
    paths = R.model_paths(R.PyTorchJob)
    assert len(paths) > 25
    # Every field our schema admits exists in the operator's API with the same JSON type.
    mismatched = {p: (t, R.sdk_path_type(p)) for p, t in paths.items() if R.sdk_path_type(p) not in (t, "any")}
    assert mismatched == {}
    # The rendered job has only fields the operator knows, with their types; planted unknown
    # fields and wrong types fail there as they fail our own schema.
    job = pick(rendered["pytorchjob"], "PyTorchJob")
    assert R.sdk_errors(job) == []
    bad = copy.deepcopy(job)
    bad["spec"]["elasticPolicy"]["minReplica"] = 1
    assert any("minReplica" in e for e in R.sdk_errors(bad))
    assert any("minReplica" in e for e in R.pytorchjob_schema_errors(bad))
    bad = copy.deepcopy(job)
    bad["spec"]["elasticPolicy"]["rdzvPort"] = "29400"
    assert any("rdzvPort" in e for e in R.sdk_errors(bad))


# -- wiring -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", R.OVERLAYS)
def test_wiring_clean(rendered, overlay):
    assert R.wiring_errors(rendered[overlay]) == []


def _job_env(res, key, value):
    env_set(container(pod_template(res)), key, value)


def _np(res):
    return _named(res, "NetworkPolicy", "elastic-emb")["spec"]


def _named(res, kind, nm):
    (hit,) = [r for r in R.of_kind(res, kind) if R.name(r) == nm]
    return hit


def _move_env_last(c, key):
    (e,) = [e for e in c["env"] if e["name"] == key]
    c["env"].remove(e)
    c["env"].append(e)


WIRING_PLANTS = {
    # endpoint: names a Service that selects the job's pods and serves the port
    ("indexed-job", "endpoint", "service name"): (
        lambda r: _job_env(r, "PET_RDZV_ENDPOINT", "elastic-emb-0.rdzv:29400"),
        "subdomain",
    ),
    ("indexed-job", "endpoint", "unknown service"): (
        lambda r: (
            _job_env(r, "PET_RDZV_ENDPOINT", "elastic-emb-0.rdzv:29400"),
            pod_template(r)["spec"].update(subdomain="rdzv"),
        ),
        "neither the rendering nor the operator",
    ),
    ("indexed-job", "endpoint", "selector misses pods"): (
        lambda r: pick(r, "Service")["spec"].update(selector={"app.kubernetes.io/instance": "other"}),
        "does not select",
    ),
    ("indexed-job", "endpoint", "not pod 0"): (
        lambda r: _job_env(r, "PET_RDZV_ENDPOINT", "elastic-emb-1.elastic-emb:29400"),
        "pod 0's hostname",
    ),
    ("indexed-job", "endpoint", "port not served"): (
        lambda r: _job_env(r, "PET_RDZV_ENDPOINT", "elastic-emb-0.elastic-emb:29500"),
        "no port targets",
    ),
    ("pytorchjob", "endpoint", "rdzvHost nowhere"): (
        lambda r: pick(r, "PyTorchJob")["spec"]["elasticPolicy"].update(rdzvHost="etcd-client"),
        "names Service 'etcd-client'",
    ),
    ("pytorchjob", "endpoint", "rdzvPort not the operator port"): (
        lambda r: pick(r, "PyTorchJob")["spec"]["elasticPolicy"].update(rdzvPort=29500),
        "does not serve it",
    ),
    # replicas within min and max; PDB keeps the minimum
    ("indexed-job", "replicas", "parallelism above max"): (
        lambda r: pick(r, "Job")["spec"].update(parallelism=9, completions=9),
        "outside the node range",
    ),
    ("indexed-job", "replicas", "min above max"): (lambda r: _job_env(r, "PET_NNODES", "5:4"), "1 <= min <= max"),
    ("indexed-job", "replicas", "not indexed"): (
        lambda r: pick(r, "Job")["spec"].update(completionMode="NonIndexed"),
        "Indexed",
    ),
    ("pytorchjob", "replicas", "replicas below min"): (
        lambda r: _worker(pick(r, "PyTorchJob")).update(replicas=1),
        "outside the node range",
    ),
    ("pytorchjob", "replicas", "pdb below min"): (
        lambda r: pick(r, "PodDisruptionBudget")["spec"].update(minAvailable=1),
        "minAvailable=1",
    ),
    # commands exist in the image
    ("pytorchjob", "commands", "preStop subcommand typo"): (
        lambda r: container(pod_template(r))["lifecycle"]["preStop"]["exec"].update(
            command=["elastic-emb", "drian", "--timeout", "60"]
        ),
        "no such subcommand",
    ),
    ("indexed-job", "commands", "preStop option typo"): (
        lambda r: container(pod_template(r))["lifecycle"]["preStop"]["exec"].update(
            command=["elastic-emb", "drain", "--timeot", "60"]
        ),
        "--timeot",
    ),
    ("indexed-job", "commands", "preStop not in image"): (
        lambda r: container(pod_template(r))["lifecycle"]["preStop"]["exec"].update(
            command=["/usr/local/bin/drain.sh"]
        ),
        "neither torchrun nor a console script",
    ),
    ("indexed-job", "commands", "no preStop"): (lambda r: container(pod_template(r)).pop("lifecycle"), "no preStop"),
    ("pytorchjob", "commands", "script missing"): (
        lambda r: container(pod_template(r)).update(
            command=["torchrun", "--rdzv-backend=elastic_emb", "/app/examples/nope.py", "--out", "/checkpoints/x"]
        ),
        "does not exist",
    ),
    ("pytorchjob", "commands", "wrong backend"): (
        lambda r: container(pod_template(r)).update(
            command=["torchrun", "--rdzv-backend=c10d", "/app/examples/train_recsys.py", "--out", "/checkpoints/x"]
        ),
        "must be elastic_emb",
    ),
    ("indexed-job", "commands", "output on read-only root"): (
        lambda r: container(pod_template(r)).update(
            command=["torchrun", "--rdzv-backend=elastic_emb", "/app/examples/train_recsys.py", "--out", "/data/x"]
        ),
        "read-only",
    ),
    # grace period outlasts the drain
    ("pytorchjob", "grace", "too short"): (
        lambda r: pod_template(r)["spec"].update(terminationGracePeriodSeconds=60),
        "terminationGracePeriodSeconds=60",
    ),
    # volumes
    ("indexed-job", "volumes", "shm on disk"): (
        lambda r: pod_template(r)["spec"]["volumes"][0]["emptyDir"].pop("medium"),
        "medium Memory",
    ),
    ("indexed-job", "volumes", "shm above memory limit"): (
        lambda r: pod_template(r)["spec"]["volumes"][0]["emptyDir"].update(sizeLimit="300Gi"),
        "below the memory limit",
    ),
    ("pytorchjob", "volumes", "state dir off shm"): (
        lambda r: _job_env(r, "ELASTIC_EMB_STATE_DIR", "/tmp/state"),
        "under /dev/shm",
    ),
    ("pytorchjob", "volumes", "durable dir not mounted"): (
        lambda r: _job_env(r, "ELASTIC_EMB_DURABLE_DIR", "/ckpt"),
        "persistentVolumeClaim",
    ),
    ("indexed-job", "volumes", "pvc missing"): (
        lambda r: r.remove(pick(r, "PersistentVolumeClaim")),
        "not in the rendering",
    ),
    # GPUs = workers per node
    ("pytorchjob", "gpus", "gpus differ from nproc"): (
        lambda r: container(pod_template(r))["resources"]["limits"].update({"nvidia.com/gpu": 4}),
        "must equal nvidia.com/gpu",
    ),
    ("indexed-job", "gpus", "no gpus"): (
        lambda r: container(pod_template(r))["resources"]["limits"].pop("nvidia.com/gpu"),
        "positive integer",
    ),
    # NetworkPolicy / PDB select the job's pods; only the job's pods, on the right ports
    ("indexed-job", "policies", "policy selects other pods"): (
        lambda r: _np(r).update(podSelector={"matchLabels": {"app": "web"}}),
        "no NetworkPolicy in the rendering selects",
    ),
    ("pytorchjob", "policies", "policy admits a namespace"): (
        lambda r: _np(r)["ingress"][0]["from"].append({"namespaceSelector": {}}),
        "not (only) the job's own pods",
    ),
    ("pytorchjob", "policies", "policy admits everyone"): (
        lambda r: _np(r)["ingress"][0].pop("from"),
        "admits every source",
    ),
    ("indexed-job", "policies", "rendezvous port closed"): (
        lambda r: _np(r)["ingress"][0]["ports"].pop(0),
        "rendezvous port 29400 is not open",
    ),
    ("pytorchjob", "policies", "ephemeral range closed"): (
        lambda r: _np(r)["ingress"][0]["ports"].pop(1),
        "ephemeral range",
    ),
    ("indexed-job", "policies", "pdb selects other pods"): (
        lambda r: pick(r, "PodDisruptionBudget")["spec"].update(selector={"matchLabels": {"app": "web"}}),
        "no PodDisruptionBudget in the rendering selects the job's pods",
    ),
    ("pytorchjob", "policies", "no network policy"): (lambda r: r.remove(pick(r, "NetworkPolicy")), "no NetworkPolicy"),
    # inner=etcd-v2: the endpoint is an etcd Service with the v2 API, isolated to the job's pods
    ("indexed-job-etcd", "endpoint", "store service selects nothing"): (
        lambda r: _named(r, "Service", "elastic-emb-etcd")["spec"].update(selector={"app": "etcd"}),
        "selects no pods",
    ),
    ("pytorchjob-etcd+etcd-v2", "endpoint", "etcd without the v2 API"): (
        lambda r: pick(r, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["command"].remove(
            "--enable-v2=true"
        ),
        "--enable-v2=true",
    ),
    ("indexed-job-etcd", "endpoint", "inner defined after its use"): (
        lambda r: _move_env_last(container(pod_template(r)), "RDZV_INNER"),
        "must be c10d, etcd-v3 or etcd-v2",
    ),
    ("pytorchjob-etcd", "policies", "store not isolated"): (
        lambda r: r.remove(_named(r, "NetworkPolicy", "elastic-emb-etcd")),
        "no NetworkPolicy isolates",
    ),
    ("indexed-job-etcd", "policies", "store client port closed"): (
        lambda r: _named(r, "NetworkPolicy", "elastic-emb-etcd")["spec"]["ingress"][0]["ports"][0].update(port=2380),
        "client port 2379 is not open",
    ),
    # the per-job label the controller sets, not only component labels
    ("indexed-job", "policies", "selector without the job-name label"): (
        lambda r: _np(r)["podSelector"]["matchLabels"].pop("batch.kubernetes.io/job-name"),
        "podSelector lacks batch.kubernetes.io/job-name",
    ),
    ("pytorchjob", "policies", "peer by component labels alone"): (
        lambda r: _np(r)["ingress"][0]["from"][0]["podSelector"]["matchLabels"].pop("training.kubeflow.org/job-name"),
        "component labels alone",
    ),
    ("indexed-job-etcd", "policies", "store admits any trainer"): (
        lambda r: _named(r, "NetworkPolicy", "elastic-emb-etcd")["spec"]["ingress"][0]["from"][0]["podSelector"][
            "matchLabels"
        ].pop("batch.kubernetes.io/job-name"),
        "component labels alone",
    ),
    # egress: the job's pods, the store, DNS; nothing else
    ("pytorchjob", "policies", "ingress only"): (
        lambda r: _np(r).update(policyTypes=["Ingress"]),
        "must include Ingress and Egress",
    ),
    ("indexed-job", "policies", "egress to anywhere"): (
        lambda r: _np(r)["egress"][0].pop("to"),
        "reaches every destination",
    ),
    ("pytorchjob", "policies", "egress to the internet"): (
        lambda r: _np(r)["egress"].append({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}),
        "neither the job's pods",
    ),
    ("indexed-job", "policies", "no dns"): (lambda r: _np(r)["egress"].pop(1), "no egress to DNS"),
    ("pytorchjob", "policies", "egress range closed"): (
        lambda r: _np(r)["egress"][0]["ports"].pop(1),
        "is not open egress to the job's pods",
    ),
    ("indexed-job-etcd", "policies", "no egress to the store"): (
        lambda r: _np(r)["egress"].pop(),
        "no egress from the job's pods to the store",
    ),
    # the NetworkPolicy's range is the pods' ephemeral range
    ("indexed-job", "policies", "pods bind outside the range"): (
        lambda r: pod_template(r)["spec"]["securityContext"]["sysctls"][0].update(value="20000 20999"),
        "ephemeral range 20000-20999",
    ),
    # every --rdzv-conf key is one the backend accepts
    ("indexed-job", "rdzv_conf", "misspelt key"): (
        lambda r: _job_env(r, "PET_RDZV_CONF", "inner=c10d,joint_timeout=900"),
        "'joint_timeout' is not one",
    ),
    ("pytorchjob-etcd", "rdzv_conf", "c10d key with etcd-v3"): (
        lambda r: pick(r, "PyTorchJob")["spec"]["elasticPolicy"]["rdzvConf"].append({"key": "is_host", "value": "1"}),
        "'is_host' is not one inner=etcd-v3",
    ),
    ("pytorchjob-etcd+etcd-v2", "rdzv_conf", "etcd-v3 key with etcd-v2"): (
        lambda r: pick(r, "PyTorchJob")["spec"]["elasticPolicy"]["rdzvConf"].append(
            {"key": "password_file", "value": "/secrets/etcd"}
        ),
        "'password_file' is not one inner=etcd-v2",
    ),
    ("pytorchjob", "rdzv_conf", "invalid value"): (
        lambda r: pick(r, "PyTorchJob")["spec"]["elasticPolicy"]["rdzvConf"].append(
            {"key": "drain_timeout", "value": "-5"}
        ),
        "drain_timeout='-5'",
    ),
    ("indexed-job-etcd", "rdzv_conf", "etcd-v3 option invalid"): (
        lambda r: _job_env(r, "PET_RDZV_CONF", "inner=etcd-v3,user=root"),
        "user and password_file together",
    ),
    # the Job completes when training ends on any allowed number of pods; restarts within budget
    ("indexed-job", "completion", "no success policy"): (
        lambda r: pick(r, "Job")["spec"].pop("successPolicy"),
        "no successPolicy rule",
    ),
    ("indexed-job", "completion", "success needs index 0"): (
        lambda r: pick(r, "Job")["spec"].update(
            successPolicy={"rules": [{"succeededIndexes": "0", "succeededCount": 1}]}
        ),
        "no successPolicy rule",
    ),
    ("indexed-job", "completion", "budget below the incidents"): (
        lambda r: pick(r, "Job")["spec"].update(backoffLimit=20),
        "backoffLimit=20",
    ),
    ("indexed-job", "completion", "per-index limit under OnFailure"): (
        lambda r: pick(r, "Job")["spec"].update(backoffLimitPerIndex=1),
        "need restartPolicy Never",
    ),
    ("pytorchjob", "completion", "budget below the incidents"): (
        lambda r: pick(r, "PyTorchJob")["spec"]["runPolicy"].update(backoffLimit=20),
        "runPolicy.backoffLimit=20",
    ),
    ("pytorchjob", "completion", "pods left behind"): (
        lambda r: pick(r, "PyTorchJob")["spec"]["runPolicy"].update(cleanPodPolicy="None"),
        "cleanPodPolicy='None'",
    ),
    # the CPU variant asks for no GPU
    ("indexed-job+cpu", "gpus", "gpu limit in the cpu variant"): (
        lambda r: container(pod_template(r))["resources"]["limits"].update({"nvidia.com/gpu": 8}),
        "CPU variant",
    ),
    ("pytorchjob-etcd+cpu", "gpus", "gpu request in the cpu variant"): (
        lambda r: container(pod_template(r))["resources"]["requests"].update({"nvidia.com/gpu": 1}),
        "CPU variant",
    ),
    # the etcd store: odd members >= 3 = --initial-cluster, one per node, a PDB that lets a drain through
    ("indexed-job-etcd", "store", "one member"): (
        lambda r: pick(r, "StatefulSet")["spec"].update(replicas=1),
        "odd number >= 3",
    ),
    ("pytorchjob-etcd", "store", "even members"): (
        lambda r: pick(r, "StatefulSet")["spec"].update(replicas=4),
        "odd number >= 3",
    ),
    ("indexed-job-etcd", "store", "initial cluster misses a member"): (
        lambda r: _etcd_flag(r, "--initial-cluster", lambda v: v.rsplit(",", 1)[0]),
        "must name exactly its 3 pods",
    ),
    ("pytorchjob-etcd", "store", "pdb blocks every drain"): (
        lambda r: _named(r, "PodDisruptionBudget", "elastic-emb-etcd").update(
            spec={
                "minAvailable": 3,
                "selector": _named(r, "PodDisruptionBudget", "elastic-emb-etcd")["spec"]["selector"],
            }
        ),
        "would block forever",
    ),
    ("indexed-job-etcd", "store", "pdb takes the quorum"): (
        lambda r: _named(r, "PodDisruptionBudget", "elastic-emb-etcd")["spec"].update(maxUnavailable=2),
        "below the quorum of 2",
    ),
    ("pytorchjob-etcd", "store", "members may share a node"): (
        lambda r: pick(r, "StatefulSet")["spec"]["template"]["spec"].pop("affinity"),
        "podAntiAffinity",
    ),
    ("indexed-job-etcd", "store", "ordered start"): (
        lambda r: pick(r, "StatefulSet")["spec"].update(podManagementPolicy="OrderedReady"),
        "Parallel",
    ),
    ("pytorchjob-etcd", "store", "history never compacted"): (
        lambda r: _etcd_flag(r, "--auto-compaction-retention", None),
        "--auto-compaction-retention",
    ),
    ("indexed-job-etcd", "store", "peer service not headless"): (
        lambda r: _named(r, "Service", "elastic-emb-etcd-peer")["spec"].pop("clusterIP"),
        "headless",
    ),
}


def _secret_entry(res):
    (e,) = [e for e in container(pod_template(res))["env"] if e["name"] == "ELASTIC_EMB_JOB_SECRET"]
    return e


WIRING_PLANTS.update(
    {
        ("indexed-job", "secret", "missing"): (
            lambda r: container(pod_template(r))["env"].remove(_secret_entry(r)),
            "is not set",
        ),
        ("pytorchjob", "secret", "literal"): (
            lambda r: (_secret_entry(r).pop("valueFrom"), _secret_entry(r).update(value="hunter2hunter2hunter2")),
            "secretKeyRef",
        ),
        ("indexed-job", "secret", "optional"): (
            lambda r: _secret_entry(r)["valueFrom"]["secretKeyRef"].update(optional=True),
            "must not be optional",
        ),
    }
)


def _pod_annotations(res):
    return pod_template(res)["metadata"]["annotations"]


def _etcd(res):
    return pick(res, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]


def _etcd_argv_replace(res, old, new):
    cmd = _etcd(res)["command"]
    cmd[:] = [a.replace(old, new) for a in cmd]


WIRING_PLANTS.update(
    {
        # names: under a namePrefix every reference must still resolve, to this job's resources
        (PREFIX + "/indexed-job", "endpoint", "literal endpoint"): (
            lambda r: _job_env(r, "PET_RDZV_ENDPOINT", "elastic-emb-0.elastic-emb:29400"),
            "pod 0's hostname",
        ),
        (PREFIX + "/indexed-job-etcd", "store", "literal member names"): (
            lambda r: _etcd_argv_replace(r, "$(SET)", "elastic-emb-etcd"),
            "must name exactly its 3 pods",
        ),
        (PREFIX + "/pytorchjob-etcd", "store", "literal peer service"): (
            lambda r: _etcd_argv_replace(r, "$(POD_NAME).$(PEER_SERVICE)", "$(POD_NAME).elastic-emb-etcd-peer"),
            "--initial-advertise-peer-urls",
        ),
        (PREFIX + "/indexed-job", "references", "secret not the job's"): (
            lambda r: _secret_entry(r)["valueFrom"]["secretKeyRef"].update(name="elastic-emb-job-secret"),
            "'team-a-elastic-emb-job-secret'",
        ),
        (PREFIX + "/pytorchjob", "references", "selector without the job's name"): (
            lambda r: pick(r, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].update(
                {"app.kubernetes.io/instance": "elastic-emb"}
            ),
            "selects no pod",
        ),
        ("indexed-job-etcd", "references", "selector by component alone"): (
            lambda r: _named(r, "PodDisruptionBudget", "elastic-emb-etcd")["spec"]["selector"]["matchLabels"].pop(
                "app.kubernetes.io/instance"
            ),
            "has no label with the job's name",
        ),
        ("pytorchjob-etcd", "references", "resource of another instance"): (
            lambda r: pick(r, "StatefulSet")["metadata"]["labels"].update({"app.kubernetes.io/instance": "other"}),
            "is not the job's name",
        ),
        ("indexed-job-etcd", "references", "annotation names no Service"): (
            lambda r: _pod_annotations(r).update({"elastic-emb.dev/rdzv-service": "etcd"}),
            "names no Service",
        ),
        ("indexed-job", "references", "subdomain names no Service"): (
            lambda r: pod_template(r)["spec"].update(subdomain="pods"),
            "spec.subdomain 'pods' names no Service",
        ),
        ("pytorchjob", "references", "pvc not rendered"): (
            lambda r: pod_template(r)["spec"]["volumes"][2]["persistentVolumeClaim"].update(claimName="ckpt"),
            "PersistentVolumeClaim 'ckpt' is not in the rendering",
        ),
        # the etcd store: 3.6 for v3, 3.5 for v2; volumes go with the job and hold the quota; sized
        ("pytorchjob-etcd", "store", "etcd 3.5 on the v3 path"): (
            lambda r: _etcd(r).update(image="quay.io/coreos/etcd:v3.5.21"),
            "etcd 3.6 or newer",
        ),
        ("pytorchjob-etcd+etcd-v2", "store", "etcd 3.6 for the v2 API"): (
            lambda r: _etcd(r).update(image="quay.io/coreos/etcd:v3.6.16"),
            "which etcd 3.6 removed",
        ),
        ("indexed-job-etcd", "store", "volumes outlive the job"): (
            lambda r: pick(r, "StatefulSet")["spec"].pop("persistentVolumeClaimRetentionPolicy"),
            "whenDeleted must be Delete",
        ),
        ("pytorchjob-etcd", "store", "volume below the quota"): (
            lambda r: pick(r, "StatefulSet")["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"].update(
                storage="1Gi"
            ),
            "below twice the backend quota",
        ),
        ("indexed-job-etcd", "store", "member without a memory limit"): (
            lambda r: _etcd(r)["resources"].pop("limits"),
            "limits.memory=None must be set",
        ),
        ("indexed-job-etcd", "store", "every member named 0"): (
            lambda r: _etcd_argv_replace(r, "--name=$(POD_NAME)", "--name=$(SET)-0"),
            "runs with --name=",
        ),
        # metrics: every port a pod opens is scraped, nothing else is, the scraper gets through
        ("indexed-job", "metrics", "metrics on, no scrape configuration"): (
            lambda r: _job_env(r, "ELASTIC_EMB_METRICS_PORT", "9400"),
            "no scrape configuration names them",
        ),
        ("pytorchjob+metrics", "metrics", "agent port only (annotations)"): (
            lambda r: (
                r.remove(pick(r, "PodMonitor")),
                _pod_annotations(r).update({"prometheus.io/scrape": "true", "prometheus.io/port": "9400"}),
            ),
            "metrics ports [9401, 9402, 9403, 9404, 9405, 9406, 9407, 9408]",
        ),
        ("indexed-job+metrics", "metrics", "fewer workers than the annotation says"): (
            lambda r: (
                _job_env(r, "PET_NPROC_PER_NODE", "4"),
                container(pod_template(r))["resources"]["limits"].update({"nvidia.com/gpu": 4}),
            ),
            "scrapes port 9405",
        ),
        ("pytorchjob+metrics", "metrics", "annotation below the workers"): (
            lambda r: _pod_annotations(r).update({R.WORKERS_ANNOTATION: "2"}),
            "metrics ports [9403, 9404, 9405, 9406, 9407, 9408]",
        ),
        ("indexed-job+metrics", "metrics", "worker port not declared"): (
            lambda r: container(pod_template(r))["ports"].pop(),
            "metrics ports [9408] are not declared",
        ),
        ("pytorchjob+metrics", "metrics", "scraper kept out"): (
            lambda r: _np(r)["ingress"].pop(),
            "no ingress rule admits the scraper",
        ),
        ("indexed-job+metrics", "policies", "scraper on every port"): (
            lambda r: _np(r)["ingress"][-1].update(ports=[{"protocol": "TCP"}]),
            "is not (only) the job's own pods",
        ),
    }
)


def _etcd_flag(res, flag, change):
    """Change (or with ``change=None`` remove) ``flag=value`` in the etcd container's command."""
    cmd = pick(res, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["command"]
    (i,) = [i for i, a in enumerate(cmd) if a.startswith(flag + "=")]
    if change is None:
        cmd.pop(i)
    else:
        cmd[i] = f"{flag}={change(cmd[i].split('=', 1)[1])}"


@pytest.mark.parametrize("key", sorted(WIRING_PLANTS), ids=lambda k: "-".join(k).replace(" ", "_"))
def test_wiring_planted_error_fails_its_rule(rendered, key):
    overlay, rule, _ = key
    res = copy.deepcopy(rendered[overlay])
    mutate, needle = WIRING_PLANTS[key]
    assert R.wiring_errors(res, only=rule) == []
    mutate(res)
    errs = R.wiring_errors(res, only=rule)
    assert any(needle in e for e in errs), errs


def test_every_wiring_rule_has_a_planted_error():
    assert {rule for _, rule, _ in WIRING_PLANTS} == set(R.WIRING_RULES)


# -- names compose: a namePrefix gives a second job of the namespace its own everything ---------------


@pytest.mark.parametrize("key", [PREFIX + "/" + k for k in R.OVERLAYS + VARIANTS])
def test_prefixed_renderings_pass_every_check(rendered, key):
    res = rendered[key]
    w = R.workload(res)
    assert w.name == PREFIX + "elastic-emb"
    assert R.wiring_errors(res) == []
    assert R.core_schema_errors(res, (R.K8S_MIN,)) == []
    assert R.field_maturity_errors(res) == []


def test_prefixed_names_reach_every_reference(rendered):
    """What the pods compute at run time follows the prefix: the rendezvous endpoint, the etcd
    members' names and peer URLs, the Secret, the PVC, the selectors' labels."""
    ij, pj = rendered[PREFIX + "/indexed-job"], rendered[PREFIX + "/pytorchjob"]
    job = "team-a-elastic-emb"
    assert R.workload(ij).endpoint == f"{job}-0.{job}:29400"
    assert R.workload(pj).endpoint == f"{job}-worker-0:29400"  # the operator's Service for worker 0
    for key in ("indexed-job-etcd", "pytorchjob-etcd"):
        res = rendered[PREFIX + "/" + key]
        assert R.workload(res).endpoint == f"{job}-etcd:2379"
        sts = pick(res, "StatefulSet")
        argv = R.command_argv(_etcd(res), R._member_meta(sts, 1))
        peers = ",".join(f"{job}-etcd-{i}=http://{job}-etcd-{i}.{job}-etcd-peer:2380" for i in range(3))
        assert f"--initial-cluster={peers}" in argv and f"--initial-cluster-token={job}-etcd" in argv
        assert f"--initial-advertise-peer-urls=http://{job}-etcd-1.{job}-etcd-peer:2380" in argv
    for res in (ij, pj):
        c = container(pod_template(res))
        assert _secret_entry(res)["valueFrom"]["secretKeyRef"]["name"] == f"{job}-job-secret"
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in pod_template(res)["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        ]
        assert claims == [f"{job}-checkpoints"] and R.name(pick(res, "PersistentVolumeClaim")) == claims[0]
        assert pick(res, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"][R.INSTANCE_LABEL] == job
        assert c["name"] == "pytorch"
    assert not any(r["kind"] == "Secret" for r in ij + pj)  # the Secret's stub never reaches the cluster


def test_a_name_suffix_composes_too(tmp_path):
    res = R.render_variant(tmp_path, "indexed-job-etcd", (), "team-a-", name_suffix="-v2")
    w = R.workload(res)
    assert w.name == "team-a-elastic-emb-v2" and w.endpoint == "team-a-elastic-emb-etcd-v2:2379"
    assert _secret_entry(res)["valueFrom"]["secretKeyRef"]["name"] == "team-a-elastic-emb-job-secret-v2"
    assert R.wiring_errors(res) == []


@pytest.mark.parametrize("key", ["indexed-job", "pytorchjob-etcd", "indexed-job-etcd+metrics+cpu"])
def test_two_jobs_share_a_namespace(rendered, tmp_path, key):
    """A second and a third job in the namespace of the first, told apart by namePrefix only: no
    name is shared, and no selector of one job picks a pod of another."""
    overlay, *components = key.split("+")
    team_b = R.render_variant(tmp_path, overlay, tuple(components), "team-b-")
    assert R.namespace_clash_errors([rendered[key], rendered[PREFIX + "/" + key], team_b]) == []
    # Planted: a selector that picks by the labels all jobs share, and a name without the prefix.
    planted = copy.deepcopy(team_b)
    pick_pdb = [p for p in R.of_kind(planted, "PodDisruptionBudget") if R.name(p) == "team-b-elastic-emb"][0]
    pick_pdb["spec"]["selector"]["matchLabels"].pop(R.INSTANCE_LABEL)
    errs = R.namespace_clash_errors([rendered[key], planted])
    assert any("also selects pods of elastic-emb" in e for e in errs), errs
    renamed = copy.deepcopy(team_b)
    pick(renamed, "PersistentVolumeClaim")["metadata"]["name"] = "elastic-emb-checkpoints"
    errs = R.namespace_clash_errors([rendered[key], renamed])
    assert any("PersistentVolumeClaim/elastic-emb-checkpoints belongs to both" in e for e in errs), errs


# -- one minimum Kubernetes version, checked against its API schema -----------------------------------


def test_minimum_version_is_the_same_everywhere_it_is_written():
    stated = R.version_statements()
    files = {f for f, _, _ in stated}
    assert {"README.md", "docs/KUBERNETES.md", str(R.VERSION_FILE.relative_to(R.REPO))} <= files, stated
    minimum = R.K8S_MIN.rsplit(".", 1)[0]
    assert [s_ for s_ in stated if s_[2] != minimum] == []
    assert R.K8S_VERSIONS[0] == R.K8S_MIN
    # The finder sees the forms a mention takes (the pre-fix kustomization comment among them).
    assert [
        m.group(1) for m in R._VERSION_MENTION.finditer("plain Kubernetes >= 1.27, or Kubernetes 1.30 or newer")
    ] == [
        "1.27",
        "1.30",
    ]


@pytest.mark.parametrize("key", ALL)
def test_every_field_is_usable_in_the_minimum_version(rendered, key):
    assert R.field_maturity_errors(rendered[key]) == []


def test_minimum_version_facts_from_the_schemas(rendered):
    """The facts the minimum rests on, read from the schemas kubernetes-validate ships: the Indexed
    Job's successPolicy is alpha in 1.30 (so 1.30 would not do), usable from 1.31; the etcd
    StatefulSet's PVC retention policy is usable at the minimum too."""
    before = f"1.{int(R.K8S_MIN.split('.')[1]) - 1}.0"
    errs = R.field_maturity_errors(rendered["indexed-job-etcd"], before)
    assert any("spec.successPolicy" in e and "alpha" in e for e in errs), errs
    assert R.field_maturity_errors(rendered["indexed-job-etcd"], R.K8S_MIN) == []
    # Planted: a field alpha at the minimum, and one the API does not have.
    res = copy.deepcopy(rendered["indexed-job"])
    pod_template(res)["spec"]["hostUsers"] = False
    errs = R.field_maturity_errors(res)
    assert any("spec.hostUsers" in e and "alpha" in e for e in errs), errs
    res = copy.deepcopy(rendered["pytorchjob"])
    pod_template(res)["spec"]["hostname2"] = "x"
    errs = R.field_maturity_errors(res)
    assert any("hostname2 does not exist" in e for e in errs), errs


# -- the PodMonitor's own schema ------------------------------------------------------------------------

PODMONITOR_PLANTS = {
    "unknown field": (lambda m: m["spec"].update(podMetricEndpoints=[]), "podMetricEndpoints"),
    "bad action": (lambda m: m["spec"]["podMetricsEndpoints"][1]["relabelings"][0].update(action="keepif"), "action"),
    "regex that does not compile": (
        lambda m: m["spec"]["podMetricsEndpoints"][1]["relabelings"][0].update(regex="[1-"),
        "does not compile",
    ),
    "port name too long": (lambda m: m["spec"]["podMetricsEndpoints"][0].update(port="metrics-worker-10"), "port"),
    "empty selector": (lambda m: m["spec"].update(selector={"matchLabels": {}}), "selector"),
}


@pytest.mark.parametrize("plant", sorted(PODMONITOR_PLANTS))
def test_podmonitor_schema_planted_error_fails(rendered, plant):
    monitor = copy.deepcopy(pick(rendered["pytorchjob+metrics"], "PodMonitor"))
    assert R.podmonitor_schema_errors(monitor) == []
    mutate, needle = PODMONITOR_PLANTS[plant]
    mutate(monitor)
    errs = R.podmonitor_schema_errors(monitor)
    assert any(needle in e for e in errs), errs


# -- a worker's metrics, served for real on a port the scrape configuration names -----------------------

METRICS_WORKER = r"""
import sys
from elastic_emb import metrics

metrics.lookups("items", 7)          # a worker's value (a no-op unless this process serves metrics)
print(metrics.serving(), flush=True)
sys.stdin.read()                     # serve until the test closes stdin
"""


def test_worker_metrics_are_served_on_a_scraped_port(rendered, tmp_path):
    """The worker of local rank 2 serves a value it recorded on ELASTIC_EMB_METRICS_PORT + 3; the
    rendered metrics variant's PodMonitor scrapes that port (with the base port the test binds)."""
    import urllib.request

    from elastic_emb.testing.ports import free_port

    rank = 2
    for _ in range(20):  # a base port whose worker port is free too
        base = free_port()
        if base + 1 + rank < 65536:
            break
    res = copy.deepcopy(rendered["indexed-job+metrics"])
    _job_env(res, "ELASTIC_EMB_METRICS_PORT", str(base))
    c = container(pod_template(res))
    ports = {p["name"]: p for p in c["ports"]}
    ports["metrics"]["containerPort"] = base
    for r in range(8):
        ports[f"metrics-w{r}"]["containerPort"] = base + 1 + r
    w = R.workload(res)
    assert R.scraped_ports(res, w).keys() == R.metrics_ports(w).keys()
    assert base + 1 + rank in R.scraped_ports(res, w)
    script = tmp_path / "metrics_worker.py"
    script.write_text(METRICS_WORKER)
    env = dict(
        os.environ,
        PYTHONPATH=str(R.REPO),
        ELASTIC_EMB_METRICS_PORT=str(base),
        ELASTIC_EMB_METRICS_ADDR="127.0.0.1",
        LOCAL_RANK=str(rank),
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == f"('worker', {base + 1 + rank})", line
        with urllib.request.urlopen(f"http://127.0.0.1:{base + 1 + rank}/metrics", timeout=10) as resp:
            body = resp.read().decode()
        assert 'elastic_emb_lookups_total{table="items"} 7.0' in body.splitlines()
    finally:
        proc.stdin.close()
        proc.wait(timeout=20)


def test_prestop_fails_when_the_image_does_not_install_the_project(rendered, tmp_path):
    text = (R.REPO / "Dockerfile").read_text()
    planted = tmp_path / "Dockerfile"
    planted.write_text(text.replace("--extra metrics /src", "--extra metrics"))
    facts = R.dockerfile_facts(planted)
    assert R.dockerfile_facts()["installs_project"] and not facts["installs_project"]
    errs = R.rule_commands(rendered["pytorchjob"], R.workload(rendered["pytorchjob"]), facts)
    assert any("does not install the project" in e for e in errs), errs


# -- Dockerfile --------------------------------------------------------------------------------------


def test_dockerfile_is_hadolint_clean_with_the_committed_config():
    rc, out = R.hadolint(R.REPO / "Dockerfile")
    assert rc == 0, out


@pytest.mark.parametrize(
    "body,needle",
    [
        ("FROM debian\nLABEL org.opencontainers.image.title=x\n", "DL3006"),  # untagged base
        ("FROM quay.io/x/y:1\n", "DL3026"),  # untrusted registry
        ("FROM debian:12.12-slim\nRUN apt-get install -y curl\n", "DL3008"),  # unpinned packages
        ("FROM debian:12.12-slim\nLABEL org.opencontainers.image.version=latest\n", "DL3056"),  # label schema
    ],
)
def test_hadolint_planted_error_fails(tmp_path, body, needle):
    planted = tmp_path / "Dockerfile"
    planted.write_text(body)
    rc, out = R.hadolint(planted)
    assert rc != 0 and needle in out, out


def test_dockerfile_shape():
    text = (R.REPO / "Dockerfile").read_text()
    facts = R.dockerfile_facts()
    assert "ARG VARIANT=cuda" in text and "AS base-cuda" in text and "AS base-cpu" in text
    assert "FROM base-${VARIANT} AS runtime" in text
    assert facts["user"] is not None and facts["user"].split(":")[0].isdigit() and facts["user"].split(":")[0] != "0"
    assert 'ENTRYPOINT ["torchrun", "--rdzv-backend=elastic_emb"]' in text
    assert facts["copies"].get("/app/examples") == "examples" and (R.REPO / "examples" / "train_recsys.py").exists()
    # The image's user is the one the templates run as (runAsUser), so volumes and fsGroup agree.
    uid = int(facts["user"].split(":")[0])
    for manifest in ("pytorchjob/pytorchjob.yaml", "indexed-job/job.yaml"):
        assert f"runAsUser: {uid}" in (R.DEPLOY / manifest).read_text()
    # Everything the image copies is let through .dockerignore's allow-list.
    ignore = (R.REPO / ".dockerignore").read_text().split()
    for src in ["pyproject.toml", "README.md", "elastic_emb/", "examples/", "deploy/image-constraints.txt"]:
        assert f"!{src}" in ignore, src


def test_image_pins_every_runtime_dependency():
    """deploy/image-constraints.txt pins (==) every runtime dependency of the package (torch is
    pinned by the Dockerfile's TORCH_VERSION), each pin inside pyproject's range."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = {}
    for line in (R.DEPLOY / "image-constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{line}: image constraints must be exact pins"
            pins[req.name.lower().replace("_", "-")] = Version(spec.version)
    deps = tomllib.loads((R.REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in map(Requirement, deps):
        key = dep.name.lower().replace("_", "-")
        if key == "torch":
            text = (R.REPO / "Dockerfile").read_text()
            version = text.split("ARG TORCH_VERSION=", 1)[1].split()[0]
            assert dep.specifier.contains(version), (dep, version)
            continue
        assert key in pins, f"{dep.name} is a runtime dependency but deploy/image-constraints.txt does not pin it"
        assert dep.specifier.contains(pins[key]), f"{dep.name}=={pins[key]} is outside pyproject's {dep.specifier}"
    assert "python-etcd" in pins  # torch's etcd-v2 rendezvous client, for the -etcd overlays


# -- the preStop drain, for real ---------------------------------------------------------------------

DRAIN_WORKER = r"""
import json, os, sys, time
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
from elastic_emb.watch.watcher import Watcher

out = Path(sys.argv[1]); rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
w = Watcher.from_env()
assert w is not None, "no watcher: ELASTIC_EMB_RDZV_ENDPOINT missing"
w.start()
(out / f"ready{rank}").write_text("1")
if os.environ.get("DRAIN_TEST_STUCK"):     # a step that outlasts the drain timeout: stuck until the test releases it
    release, stuck_until = out / "release", time.monotonic() + 120
    while not release.exists() and time.monotonic() < stuck_until:
        time.sleep(0.05)
step, deadline = 0, time.monotonic() + 60
while time.monotonic() < deadline:
    t = torch.ones(1)
    dist.all_reduce(t)                     # the step's collective keeps the ranks in lockstep
    time.sleep(0.02)                       # ... and its commit
    if w.drain_requested(step):
        w.ack_drain(step)
        (out / f"stopped{rank}.json").write_text(json.dumps({"rank": rank, "step": step, "stop": w.stop_step}))
        break
    step += 1
time.sleep(1.0)                            # what wait_for_restart does: stop stepping, stay alive
w.stop()
dist.destroy_process_group()
"""


def _torchrun(
    tmp_path: Path,
    port: int,
    nproc: int,
    extra_env: dict | None = None,
    *,
    inner: str = "c10d",
    endpoint: str | None = None,
) -> subprocess.Popen:
    script = tmp_path / "drain_worker.py"
    script.write_text(DRAIN_WORKER)
    env = dict(
        os.environ, PYTHONPATH=str(R.REPO), OMP_NUM_THREADS="1", ELASTIC_EMB_LOG_FORMAT="json", **(extra_env or {})
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=elastic_emb",
        f"--rdzv-endpoint={endpoint or f'127.0.0.1:{port}'}",
        "--rdzv-id=drainjob",
        f"--rdzv-conf=inner={inner},join_timeout=30" + (",is_host=1" if inner == "c10d" else ""),
        "--max-restarts=0",
        "--monitor-interval=0.1",
        str(script),
        str(tmp_path),
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stop(proc: subprocess.Popen) -> str:
    """SIGTERM torchrun (the agent then stops its workers: a SIGKILL would orphan them), bounded."""
    if proc.poll() is None:
        proc.terminate()
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=10)
    return out or ""


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    out = _stop(proc)
    pytest.fail(f"workers never wrote {[p.name for p in paths if not p.exists()]}; torchrun output:\n{out[-4000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["c10d", "etcd-v2", "etcd-v3"])
def test_drain_cli_stops_real_workers_at_one_committed_step(tmp_path, request, inner):
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    if inner.startswith("etcd"):  # the -etcd overlays: the rendezvous (and the drain keys) live in etcd
        endpoint = request.getfixturevalue("etcd_server").endpoint
    proc = _torchrun(tmp_path, port, nproc=2, inner=inner, endpoint=endpoint)
    try:
        _wait_for([tmp_path / "ready0", tmp_path / "ready1"], proc, 60)
        # As the preStop hook runs it: only the pod's PET_* variables, no flags but the timeout.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTIC_EMB_RDZV", "TORCHELASTIC_"))}
        env.update(PET_RDZV_ENDPOINT=endpoint, PET_RDZV_ID="drainjob", PET_RDZV_CONF=f"inner={inner},join_timeout=30")
        drain = subprocess.run(
            [sys.executable, "-m", "elastic_emb.cli.main", "drain", "--timeout", "20"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert drain.returncode == 0, drain.stderr[-3000:]
        outcome = json.loads(drain.stdout.strip().splitlines()[-1])
        assert outcome["outcome"] == "acknowledged" and outcome["acks"] == outcome["expected"] == 2, outcome
        _wait_for([tmp_path / "stopped0.json", tmp_path / "stopped1.json"], proc, 10)
        stopped = [json.loads((tmp_path / f"stopped{r}.json").read_text()) for r in (0, 1)]
        # Both ranks stopped after the same step, the one the CLI reports.
        assert stopped[0]["step"] == stopped[1]["step"] == outcome["stop_step"], (stopped, outcome)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out[-3000:]
    finally:
        _stop(proc)


@pytest.mark.slow
def test_drain_cli_times_out_when_workers_do_not_ack(tmp_path):
    """A worker stuck in a step longer than the drain timeout: the hook's wait is bounded, exit 3."""
    port = free_port()
    proc = _torchrun(tmp_path, port, nproc=1, extra_env={"DRAIN_TEST_STUCK": "1"})
    try:
        _wait_for([tmp_path / "ready0"], proc, 60)
        start = time.monotonic()
        drain = subprocess.run(
            [
                sys.executable,
                "-m",
                "elastic_emb.cli.main",
                "drain",
                "--timeout",
                "1.5",
                "--endpoint",
                f"127.0.0.1:{port}",
                "--run-id",
                "drainjob",
                "--inner",
                "c10d",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - start
        assert drain.returncode == 3, drain.stderr[-3000:]
        outcome = json.loads(drain.stdout.strip().splitlines()[-1])
        assert outcome["outcome"] == "timeout" and outcome["acks"] == 0 and outcome["expected"] == 1, outcome
        assert 1.5 <= outcome["elapsed_s"] < elapsed
    finally:
        (tmp_path / "release").write_text("1")
        _stop(proc)


def test_drain_cli_reports_an_unreachable_rendezvous():
    port = free_port()  # nothing listens there
    drain = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_emb.cli.main",
            "drain",
            "--endpoint",
            f"127.0.0.1:{port}",
            "--connect-timeout",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("PET_")},
    )
    assert drain.returncode == 2
    assert f"127.0.0.1:{port}" in drain.stderr and "drain_failed" in drain.stderr


def test_drain_target_reads_the_pod_environment():
    from elastic_emb.cli.drain import DrainError, DrainTarget

    t = DrainTarget.from_env(
        {"PET_RDZV_ENDPOINT": "etcd:2379", "PET_RDZV_ID": "job", "PET_RDZV_CONF": "a=1,inner=etcd-v2"}
    )
    assert (t.endpoint, t.run_id, t.inner) == ("etcd:2379", "job", "etcd-v2")
    t = DrainTarget.from_env(
        {
            "PET_RDZV_ENDPOINT": "x:1",
            "ELASTIC_EMB_RDZV_ENDPOINT": "y:2",
            "ELASTIC_EMB_RDZV_BACKEND": "c10d",
            "TORCHELASTIC_RUN_ID": "r",
        }
    )
    assert (t.endpoint, t.run_id, t.inner) == ("y:2", "r", "c10d")
    with pytest.raises(DrainError, match="PET_RDZV_ENDPOINT"):
        DrainTarget.from_env({})
    with pytest.raises(DrainError, match="'zk'"):
        DrainTarget.from_env({"PET_RDZV_ENDPOINT": "x:1", "PET_RDZV_CONF": "inner=zk"})


# -- the README describes what the templates do ------------------------------------------------------


def test_readme_deploy_section_matches_the_templates(rendered):
    readme = (R.REPO / "README.md").read_text()
    section = readme.split("## Deploy on Kubernetes", 1)[1].split("\n## ", 1)[0]
    # The same overlays, no more, no fewer.
    named = set(__import__("re").findall(r"kubectl apply -k deploy/([a-z0-9-]+)`", section))
    assert named == set(R.OVERLAYS)
    # The params block shown is the params file's.
    block = section.split("```yaml", 1)[1].split("```", 1)[0]
    shown = yaml.safe_load(block)["spec"]
    assert shown == yaml.safe_load((R.DEPLOY / "params" / "params.yaml").read_text())["spec"]
    # The numbers it states are the rendered ones.
    for overlay in R.OVERLAYS:
        w = R.workload(rendered[overlay])
        spec, c = w.pod_template["spec"], container(w.pod_template)
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
        pre = c["lifecycle"]["preStop"]["exec"]["command"]
        assert f"terminationGracePeriodSeconds: {spec['terminationGracePeriodSeconds']}" in section
        assert f"`{' '.join(pre)}`" in section and f"at most {R.drain_timeout(pre):g} s" in section
        assert f"sizeLimit: {shm}" in section and f"{c['resources']['limits']['memory']} memory limit" in section
        assert f"{R.EPHEMERAL[0]}-{R.EPHEMERAL[1]}" in section
        host, _, port = w.endpoint.rpartition(":")
        assert f"{host}:{port}" in section or (w.inner.startswith("etcd") and host in section and port in section), (
            w.endpoint
        )


def test_drain_with_no_rendezvous_round_returns_at_once():
    """A preStop during start-up (the store is up, no round has completed): nothing to drain."""
    from datetime import timedelta

    import torch.distributed as dist

    from elastic_emb.cli.drain import DrainTarget, request_drain

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), use_libuv=True)
    try:
        out = request_drain(DrainTarget(inner="c10d", endpoint=f"127.0.0.1:{port}", run_id="nothing-yet"), timeout=5)
        assert out.outcome == "no_running_round" and out.ok and out.round is None and out.elapsed_s < 5
        with pytest.raises(ValueError, match="timeout"):
            request_drain(DrainTarget(inner="c10d", endpoint=f"127.0.0.1:{port}", run_id="x"), timeout=0)
    finally:
        del store
