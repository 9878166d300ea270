"""Offline checks for the Kubernetes templates in deploy/ and the Dockerfile (used by test_deploy.py).

Three layers, each returning a list of human-readable findings (empty = clean), so a test can
assert on the exact rule a planted error breaks:

1. :func:`render` runs ``kubectl kustomize`` (kubectl ships kustomize; no cluster is contacted).
2. Schemas. Core kinds go through ``kubernetes-validate --strict`` for every supported
   Kubernetes version (:data:`K8S_VERSIONS`). PyTorchJob is a custom resource that tool only
   warns about, so it has a schema of our own here: :class:`PyTorchJob` (pydantic, strict types,
   unknown fields rejected) for the fields the project uses, plus :func:`admission_errors`, the
   checks the training operator's admission webhook (v1.9) applies on create; its pod template
   goes through the core ``PodTemplateSpec`` schema. ``test_deploy.py`` cross-checks our schema
   and the rendered job against the operator's own API types, from its published SDK
   (:func:`sdk_path_type`, :func:`sdk_errors`).
3. :func:`wiring_errors`: rules no schema can express, which decide whether the job works at all:
   the rendezvous endpoint names a Service that selects the job's pods and serves the port;
   replicas lie within the node range; the preStop and main commands exist in the image; the
   NetworkPolicy and the PodDisruptionBudget select the job's pods (by the controller's job-name
   label) and open the rendezvous port and the pods' ephemeral range, both ways, plus DNS and the
   store; the grace period outlasts the drain; /dev/shm is a sized memory volume within the memory
   limit; the durable tier is a mounted PVC; GPUs requested = workers per node, none in the CPU
   variant; every ``--rdzv-conf`` key is one the backend accepts; the Job completes when training
   ends on any allowed number of pods and its restart budget covers 25 incidents; the etcd store
   has an odd number (>= 3) of members matching its --initial-cluster, one per node, and a
   disruption budget that lets a drain take one member but never the quorum.

How the training operator turns a PyTorchJob into pods is modelled from its documented
behaviour (v1.9): pods get the labels ``training.kubeflow.org/job-name``, ``replica-type``
(lower case) and ``replica-index``; each replica gets a headless Service
``<job>-<type>-<index>`` selecting exactly that pod and exposing the container port named
``pytorchjob-port``; with an elasticPolicy torchrun gets ``PET_RDZV_ENDPOINT=<rdzvHost or
<job>-worker-0>:<rdzvPort or pytorchjob-port>`` and ``PET_NNODES=<minReplicas>:<maxReplicas>``.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = ("pytorchjob", "indexed-job", "pytorchjob-etcd", "indexed-job-etcd")
# Components a user adds to an overlay (rendered by the tests through render_variant).
COMPONENTS = ("cpu", "no-endport", "etcd-v2")
# Kubernetes versions the templates support: the Indexed Job's successPolicy is on by default
# from 1.31 (beta; GA in 1.33); the newest is what kubernetes-validate knows.
K8S_VERSIONS = tuple(f"1.{m}.0" for m in range(31, 38))
CONTAINER = "pytorch"  # the training operator's default container name; the templates use it everywhere
OPERATOR_PORT_NAME = "pytorchjob-port"
OPERATOR_DEFAULT_PORT = 23456
DRAIN_MARGIN_S = 30  # grace period beyond the drain timeout: the commit flush and torchrun's own shutdown
EPHEMERAL = (32768, 60999)  # Linux ip_local_port_range default: MASTER_PORT store, gloo and NCCL sockets
PORT_RANGE_SYSCTL = "net.ipv4.ip_local_port_range"
INCIDENTS = 25  # whole-job incidents (every agent restarted once) the restart budget must cover
JOB_NAME_LABELS = {"Job": "batch.kubernetes.io/job-name", "PyTorchJob": "training.kubeflow.org/job-name"}


# -- rendering -----------------------------------------------------------------------------------


class RenderError(RuntimeError):
    pass


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(overlay: str | Path, timeout: float = 60.0) -> list[dict]:
    """The resources ``kubectl kustomize <overlay>`` renders (offline; no cluster is contacted)."""
    exe = kubectl()
    if exe is None:
        raise RenderError("kubectl is not on PATH: install kubectl (it bundles kustomize) to render deploy/")
    path = Path(overlay) if Path(overlay).is_absolute() else DEPLOY / overlay
    proc = subprocess.run([exe, "kustomize", str(path)], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RenderError(f"kubectl kustomize {path} failed (rc={proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def render_variant(workdir: Path, overlay: str, components: tuple[str, ...]) -> list[dict]:
    """An overlay with components of deploy/components added, as a user's kustomization would
    (written under ``workdir``, which must be outside the repository's deploy/)."""
    root = Path(workdir) / ("-".join((overlay,) + components))
    root.mkdir(parents=True, exist_ok=True)
    rel = lambda p: str(Path(__import__("os").path.relpath(p, root)))  # noqa: E731
    kust = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [rel(DEPLOY / overlay)],
        "components": [rel(DEPLOY / "components" / c) for c in components],
    }
    (root / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    return render(root)


# -- layer 2a: core kinds through kubernetes-validate -------------------------------------------------


def core_schema_errors(resources: list[dict], versions: tuple[str, ...] = K8S_VERSIONS) -> list[str]:
    """Strict schema findings for every core resource (and every PyTorchJob pod template)."""
    import kubernetes_validate as kv

    errors = []
    for version in versions:
        for res in resources:
            docs = [res]
            if res.get("kind") == "PyTorchJob":
                docs = [
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": f"{name(res)}-{rtype.lower()}"},
                        "template": spec.get("template"),
                    }
                    for rtype, spec in (res.get("spec", {}).get("pytorchReplicaSpecs") or {}).items()
                    if isinstance(spec, dict)
                ]
            for doc in docs:
                try:
                    kv.validate(doc, version, strict=True)
                except kv.ValidationError as exc:
                    path = "/".join(str(p) for p in exc.absolute_path)
                    errors.append(f"k8s {version} {doc.get('kind')}/{name(doc)} at {path or '<root>'}: {exc.message}")
                except kv.SchemaNotFoundError as exc:
                    errors.append(f"k8s {version} has no schema for {doc.get('apiVersion')} {doc.get('kind')}: {exc}")
    return errors


# -- layer 2b: our own PyTorchJob schema and the operator's admission rules ----------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ObjectMeta(_Strict):
    name: str = Field(min_length=1)
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class RdzvConf(_Strict):
    key: str = Field(min_length=1)
    value: str


class ElasticPolicy(_Strict):
    minReplicas: int | None = Field(default=None, ge=1, le=2**31 - 1)
    maxReplicas: int | None = Field(default=None, ge=1, le=2**31 - 1)
    maxRestarts: int | None = Field(default=None, ge=0, le=2**31 - 1)
    rdzvBackend: str | None = None
    rdzvConf: list[RdzvConf] | None = None
    rdzvHost: str | None = None
    rdzvId: str | None = None
    rdzvPort: int | None = Field(default=None, ge=1, le=65535)
    nProcPerNode: int | None = Field(default=None, ge=1, le=2**31 - 1)
    standalone: bool | None = None


class RunPolicy(_Strict):
    cleanPodPolicy: Literal["None", "Running", "All"] | None = None
    backoffLimit: int | None = Field(default=None, ge=0, le=2**31 - 1)
    activeDeadlineSeconds: int | None = Field(default=None, ge=1)
    ttlSecondsAfterFinished: int | None = Field(default=None, ge=0, le=2**31 - 1)
    suspend: bool | None = None


class ReplicaSpec(_Strict):
    replicas: int | None = Field(default=None, ge=0, le=2**31 - 1)
    restartPolicy: Literal["Always", "OnFailure", "Never", "ExitCode"] | None = None
    template: dict[str, Any]  # a core PodTemplateSpec: checked by core_schema_errors


class PyTorchJobSpec(_Strict):
    elasticPolicy: ElasticPolicy | None = None
    nprocPerNode: str | None = Field(default=None, pattern=r"^(auto|cpu|gpu|[1-9][0-9]*)$")
    runPolicy: RunPolicy | None = None
    pytorchReplicaSpecs: dict[Literal["Master", "Worker"], ReplicaSpec]


class PyTorchJob(_Strict):
    """The subset of kubeflow.org/v1 PyTorchJob this project writes (anything else is rejected)."""

    apiVersion: Literal["kubeflow.org/v1"]
    kind: Literal["PyTorchJob"]
    metadata: ObjectMeta
    spec: PyTorchJobSpec


DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def pytorchjob_schema_errors(job: dict) -> list[str]:
    try:
        PyTorchJob.model_validate(job)
    except ValidationError as exc:
        return [f"PyTorchJob/{name(job)} {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
    return []


def admission_errors(job: dict) -> list[str]:
    """The training operator's admission webhook checks (v1.9) for a PyTorchJob create."""
    errors = []
    jname = name(job)
    if len(jname) > 63 or not DNS1035.match(jname):
        errors.append(
            f"metadata.name {jname!r} must be a DNS-1035 label (lower-case alphanumerics and '-', "
            f"starting with a letter, at most 63 characters)"
        )
    spec = job.get("spec") or {}
    specs = spec.get("pytorchReplicaSpecs") or {}
    ep = spec.get("elasticPolicy")
    if ep is not None:
        if spec.get("nprocPerNode") is not None and ep.get("nProcPerNode") is not None:
            errors.append("spec.elasticPolicy.nProcPerNode must not be set together with spec.nprocPerNode")
        worker = specs.get("Worker")
        if worker is None:
            errors.append("spec.pytorchReplicaSpecs.Worker must be configured when spec.elasticPolicy is set")
        else:
            replicas = worker.get("replicas", 1)
            lo, hi = ep.get("minReplicas"), ep.get("maxReplicas")
            if lo is not None and hi is not None and lo > hi:
                errors.append(f"spec.elasticPolicy.minReplicas={lo} must be <= maxReplicas={hi}")
            if lo is not None and replicas < lo:
                errors.append(
                    f"spec.pytorchReplicaSpecs.Worker.replicas={replicas} must be >= elasticPolicy.minReplicas={lo}"
                )
            if hi is not None and replicas > hi:
                errors.append(
                    f"spec.pytorchReplicaSpecs.Worker.replicas={replicas} must be <= elasticPolicy.maxReplicas={hi}"
                )
    for rtype, rspec in specs.items():
        where = f"spec.pytorchReplicaSpecs.{rtype}"
        containers = ((rspec or {}).get("template") or {}).get("spec", {}).get("containers") or []
        if not containers:
            errors.append(f"{where}.template.spec.containers must not be empty")
        for i, c in enumerate(containers):
            if not c.get("image"):
                errors.append(f"{where}.template.spec.containers[{i}].image must be set")
        if containers and not any(c.get("name") == CONTAINER for c in containers):
            errors.append(f"{where}: there must be a container named {CONTAINER!r} (the operator's default container)")
        if rtype == "Master" and (rspec or {}).get("replicas", 1) != 1:
            errors.append(f"{where}.replicas must be 1")
    return errors


# -- layer 2c: cross-check against the operator's own API types ---------------------------------
#
# The training operator publishes its API as a Python SDK (PyPI ``kubeflow-training``, the same
# release as the operator the templates target), generated from the operator's OpenAPI spec: each
# model class lists its fields (``attribute_map``: attribute -> JSON key) and their types
# (``openapi_types``). Pod templates and other core types come from the ``kubernetes`` client's
# models, generated the same way. Both are installed from the registry by the test extra, so the
# cross-check needs nothing outside the project.

SDK_ROOT = "KubeflowOrgV1PyTorchJob"
_SDK_SCALARS = {
    "int": "integer",
    "str": "string",
    "bool": "boolean",
    "float": "number",
    "datetime": "string",
    "date": "string",
}


def _sdk_class(type_name: str) -> Any:
    """The SDK model class of ``type_name`` (the operator's or a Kubernetes core type), or None."""
    import kubeflow.training.models as operator_models
    import kubernetes.client.models as core_models

    return getattr(operator_models, type_name, None) or getattr(core_models, type_name, None)


def _sdk_dict_value(type_name: str) -> str:
    """'dict(str, X)' -> 'X'."""
    return type_name[len("dict(") : -1].split(", ", 1)[1]


def sdk_json_type(type_name: str) -> str:
    """JSON type of an SDK type string; 'any' for the untyped ``object`` (e.g. int-or-string)."""
    if type_name == "object":
        return "any"
    if type_name.startswith("list["):
        return "array"
    if type_name.startswith("dict(") or _sdk_class(type_name) is not None:
        return "object"
    return _SDK_SCALARS.get(type_name, "object")


def sdk_path_type(path: str) -> str | None:
    """The SDK's JSON type at a model_paths() path, or None when the operator's API has no such field."""
    node = SDK_ROOT
    for part in path.split("."):
        array = part.endswith("[]")
        part = part.removesuffix("[]")
        cls = _sdk_class(node)
        if cls is not None:
            attrs = {key: attr for attr, key in cls.attribute_map.items()}
            if part not in attrs:
                return None
            node = cls.openapi_types[attrs[part]]
        elif node.startswith("dict("):
            node = _sdk_dict_value(node)
        else:
            return None
        if array:
            if not node.startswith("list["):
                return None
            node = node[len("list[") : -1]
    return sdk_json_type(node)


def sdk_errors(job: dict) -> list[str]:
    """Fields of a rendered PyTorchJob that the operator's API does not have, or has with another type."""
    errors: list[str] = []

    def check(value: Any, type_name: str, where: str) -> None:
        if type_name == "object":
            return
        if type_name.startswith("list["):
            if not isinstance(value, list):
                errors.append(f"SDK {where}: {value!r} is not an array")
                return
            for i, item in enumerate(value):
                check(item, type_name[len("list[") : -1], f"{where}[{i}]")
            return
        if type_name.startswith("dict("):
            if not isinstance(value, dict):
                errors.append(f"SDK {where}: {value!r} is not an object")
                return
            for key, item in value.items():
                check(item, _sdk_dict_value(type_name), f"{where}/{key}")
            return
        cls = _sdk_class(type_name)
        if cls is not None:
            if not isinstance(value, dict):
                errors.append(f"SDK {where}: {value!r} is not a {type_name} object")
                return
            attrs = {key: attr for attr, key in cls.attribute_map.items()}
            for key, item in value.items():
                if key not in attrs:
                    errors.append(f"SDK {where}/{key}: {type_name} has no field {key!r}")
                else:
                    check(item, cls.openapi_types[attrs[key]], f"{where}/{key}")
            return
        want = _SDK_SCALARS.get(type_name)
        ok = {
            "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "boolean": lambda v: isinstance(v, bool),
            "string": lambda v: isinstance(v, str),
        }.get(want)
        if ok is not None and not ok(value):
            errors.append(f"SDK {where}: {value!r} is not of type {want}")

    check({k: v for k, v in job.items() if k != "status"}, SDK_ROOT, "")
    return errors


def _leaf_type(ann: Any) -> tuple[str, Any]:
    """(JSON type, the annotation without Optional) of a pydantic field annotation."""
    import types
    import typing

    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        (ann,) = [a for a in typing.get_args(ann) if a is not type(None)]
    origin = typing.get_origin(ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "object", ann
    if origin is list:
        return "array", ann
    if origin is dict:
        return "object", ann
    if origin is Literal:
        return "string", ann
    return {bool: "boolean", int: "integer", str: "string"}.get(ann, "object"), ann


def model_paths(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Field path -> JSON type for every field our PyTorchJob schema allows. ``metadata``'s
    children are left out: the operator declares metadata as a bare object (the API server
    checks ObjectMeta itself)."""
    import typing

    out: dict[str, str] = {}
    for fname, field in model.model_fields.items():
        path = f"{prefix}.{fname}" if prefix else fname
        kind, ann = _leaf_type(field.annotation)
        out[path] = kind
        if ann is ObjectMeta:
            continue
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(model_paths(ann, path))
        elif typing.get_origin(ann) is list:
            (item,) = typing.get_args(ann)
            if isinstance(item, type) and issubclass(item, BaseModel):
                out.update(model_paths(item, path + "[]"))
        elif typing.get_origin(ann) is dict:
            key, val = typing.get_args(ann)
            if isinstance(val, type) and issubclass(val, BaseModel):
                for k in typing.get_args(key) or ("*",):
                    out.update(model_paths(val, f"{path}.{k}"))
    return out


# -- layer 3: wiring ------------------------------------------------------------------------


def name(res: dict) -> str:
    return str((res.get("metadata") or {}).get("name", ""))


def of_kind(resources: list[dict], kind: str) -> list[dict]:
    return [r for r in resources if r.get("kind") == kind]


class Workload(BaseModel):
    """The one training workload in a rendering, reduced to what the wiring rules look at."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    kind: str
    name: str
    pod_template: dict
    pod_labels: dict[str, str]  # template labels + the labels the controller adds (pod 0's)
    replicas: int
    min_nodes: int
    max_nodes: int
    nproc: str | None
    endpoint: str | None
    endpoint_services: list[dict]  # Services that exist for the pods (rendered or operator-made)
    rdzv_backend: str | None
    inner: str  # the elastic_emb backend's inner rendezvous: c10d (pod 0 hosts it), etcd-v3 or etcd-v2
    rdzv_conf: dict[str, str]  # every --rdzv-conf key and value (PET_RDZV_CONF / rdzvConf)


def _env(container: dict) -> dict[str, Any]:
    return {e.get("name"): e for e in container.get("env") or []}


def _env_value(container: dict, key: str) -> str | None:
    """The value the container sees, with ``$(VAR)`` expanded as the kubelet does: only from
    variables defined earlier in the list; an unresolvable reference stays as written."""
    seen: dict[str, str] = {}
    for e in container.get("env") or []:
        value = e.get("value")
        if value is not None:
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: seen.get(m.group(1), m.group(0)), str(value))
            seen[e.get("name")] = value
        if e.get("name") == key:
            return value
    return None


def _conf_value(conf: str | None, key: str) -> str | None:
    for item in (conf or "").split(","):
        k, sep, v = item.partition("=")
        if sep and k.strip() == key:
            return v.strip()
    return None


def _conf_items(conf: str | None) -> dict[str, str]:
    out = {}
    for item in (conf or "").split(","):
        k, sep, v = item.partition("=")
        if k.strip():
            out[k.strip()] = v.strip() if sep else ""
    return out


def _container(pod_template: dict) -> dict:
    for c in (pod_template.get("spec") or {}).get("containers") or []:
        if c.get("name") == CONTAINER:
            return c
    return {}


def _nnodes(value: str | None) -> tuple[int, int]:
    if not value:
        return (1, 1)
    lo, _, hi = str(value).partition(":")
    return int(lo), int(hi or lo)


def workload(resources: list[dict]) -> Workload:
    jobs = of_kind(resources, "PyTorchJob") + of_kind(resources, "Job")
    if len(jobs) != 1:
        raise ValueError(f"expected exactly one PyTorchJob or Job in the rendering, found {[name(j) for j in jobs]}")
    job = jobs[0]
    jname = name(job)
    if job["kind"] == "PyTorchJob":
        spec = job["spec"]
        worker = spec["pytorchReplicaSpecs"]["Worker"]
        tmpl = worker["template"]
        ep = spec.get("elasticPolicy") or {}
        c = _container(tmpl)
        port = ep.get("rdzvPort")
        if port is None:
            ports = [p for p in c.get("ports") or [] if p.get("name") == OPERATOR_PORT_NAME]
            port = ports[0]["containerPort"] if ports else OPERATOR_DEFAULT_PORT
        host = ep.get("rdzvHost") or f"{jname}-worker-0"
        replicas = worker.get("replicas", 1)
        labels = dict((tmpl.get("metadata") or {}).get("labels") or {})
        operator_labels = {"training.kubeflow.org/job-name": jname, "training.kubeflow.org/replica-type": "worker"}
        labels.update(operator_labels, **{"training.kubeflow.org/replica-index": "0"})
        # The per-replica headless Services the operator creates (one per worker index).
        op_ports = [p for p in c.get("ports") or [] if p.get("name") == OPERATOR_PORT_NAME]
        services = [
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": f"{jname}-worker-{i}"},
                "spec": {
                    "clusterIP": "None",
                    "selector": dict(operator_labels, **{"training.kubeflow.org/replica-index": str(i)}),
                    "ports": [
                        {"name": p["name"], "port": p["containerPort"], "targetPort": p["containerPort"]}
                        for p in op_ports
                    ],
                },
                "_operator_made": True,
            }
            for i in range(replicas)
        ]
        conf = {c.get("key"): c.get("value") for c in ep.get("rdzvConf") or []}
        inner = conf.get("inner", "c10d")
        return Workload(
            kind="PyTorchJob",
            name=jname,
            pod_template=tmpl,
            pod_labels=labels,
            replicas=replicas,
            min_nodes=ep.get("minReplicas", replicas),
            max_nodes=ep.get("maxReplicas", replicas),
            nproc=spec.get("nprocPerNode"),
            endpoint=f"{host}:{port}",
            endpoint_services=services + of_kind(resources, "Service"),
            rdzv_backend=ep.get("rdzvBackend"),
            inner=inner,
            rdzv_conf=conf,
        )
    spec = job["spec"]
    tmpl = spec["template"]
    c = _container(tmpl)
    lo, hi = _nnodes(_env_value(c, "PET_NNODES"))
    labels = dict((tmpl.get("metadata") or {}).get("labels") or {})
    labels.update(
        {"batch.kubernetes.io/job-name": jname, "job-name": jname, "batch.kubernetes.io/job-completion-index": "0"}
    )
    return Workload(
        kind="Job",
        name=jname,
        pod_template=tmpl,
        pod_labels=labels,
        replicas=spec.get("parallelism", 1),
        min_nodes=lo,
        max_nodes=hi,
        nproc=_env_value(c, "PET_NPROC_PER_NODE"),
        endpoint=_env_value(c, "PET_RDZV_ENDPOINT"),
        endpoint_services=of_kind(resources, "Service"),
        rdzv_backend=_env_value(c, "PET_RDZV_BACKEND"),
        inner=_conf_value(_env_value(c, "PET_RDZV_CONF"), "inner") or "c10d",
        rdzv_conf=_conf_items(_env_value(c, "PET_RDZV_CONF")),
    )


def _selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """matchLabels/matchExpressions (or a Service's plain selector) against a pod's labels."""
    if not selector:
        return False
    match = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if not isinstance(match, dict) or not all(labels.get(k) == v for k, v in match.items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, vals = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and labels.get(key) in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return bool(match) or bool(selector.get("matchExpressions"))


def _port_number(container: dict, ref: Any) -> int | None:
    if isinstance(ref, int):
        return ref
    for p in container.get("ports") or []:
        if p.get("name") == ref:
            return p.get("containerPort")
    return None


def rule_endpoint(resources: list[dict], w: Workload) -> list[str]:
    """The rendezvous endpoint names a Service that selects the job's pod 0 and serves the port."""
    if not w.endpoint:
        return [f"{w.kind}/{w.name}: no rendezvous endpoint (PET_RDZV_ENDPOINT or elasticPolicy)"]
    host, _, port_s = w.endpoint.rpartition(":")
    if not host or not port_s.isdigit():
        return [f"{w.kind}/{w.name}: rendezvous endpoint {w.endpoint!r} is not HOST:PORT"]
    port = int(port_s)
    if w.inner in ("etcd-v2", "etcd-v3"):
        return _etcd_endpoint_errors(resources, w, host, port)
    if w.inner != "c10d":
        return [
            f"{w.kind}/{w.name}: inner rendezvous {w.inner!r} must be c10d, etcd-v3 or etcd-v2 (an unexpanded $(VAR)?)"
        ]
    c = _container(w.pod_template)
    pod_spec = w.pod_template.get("spec") or {}
    errors = []
    parts = host.split(".")
    if w.kind == "Job":
        # <hostname>.<subdomain>[.<namespace>...]: pod i of an Indexed Job is `<job>-<i>`.
        if len(parts) < 2:
            return [f"Job/{w.name}: rendezvous host {host!r} must be `<job>-0.<headless service>` (a pod DNS name)"]
        if parts[0] != f"{w.name}-0":
            errors.append(f"Job/{w.name}: rendezvous host {host!r} must start with pod 0's hostname {w.name}-0")
        svc_name = parts[1]
        if pod_spec.get("subdomain") != svc_name:
            errors.append(
                f"Job/{w.name}: pod subdomain {pod_spec.get('subdomain')!r} must equal the endpoint's "
                f"service {svc_name!r}, or `{host}` does not resolve"
            )
    else:
        svc_name = parts[0]
    svcs = [s for s in w.endpoint_services if name(s) == svc_name]
    if not svcs:
        return errors + [
            f"{w.kind}/{w.name}: rendezvous endpoint {w.endpoint!r} names Service {svc_name!r}, "
            f"which neither the rendering nor the operator provides "
            f"(have {[name(s) for s in w.endpoint_services]})"
        ]
    svc = svcs[0]
    sspec = svc.get("spec") or {}
    if not _selects(sspec.get("selector"), w.pod_labels):
        errors.append(
            f"Service/{svc_name}: selector {sspec.get('selector')} does not select the job's pod 0 "
            f"(labels {w.pod_labels})"
        )
    if w.kind == "Job":
        if sspec.get("clusterIP") != "None":
            errors.append(f"Service/{svc_name}: must be headless (clusterIP: None) to give pods DNS names")
        served = [p for p in sspec.get("ports") or [] if _port_number(c, p.get("targetPort", p.get("port"))) == port]
        if not served:
            errors.append(f"Service/{svc_name}: no port targets the rendezvous port {port}")
    else:
        served = [p for p in sspec.get("ports") or [] if p.get("port") == port]
        if not served:
            errors.append(
                f"{w.kind}/{w.name}: rendezvous port {port} is not the pytorch container's "
                f"{OPERATOR_PORT_NAME!r} port, so the operator's Service {svc_name} does not serve it"
            )
    if not any(p.get("containerPort") == port for p in c.get("ports") or []):
        errors.append(f"{w.kind}/{w.name}: container {CONTAINER!r} does not declare the rendezvous port {port}")
    return errors


def store_pods(resources: list[dict], svc: dict) -> list[tuple[dict, dict]]:
    """(workload, pod template) of every StatefulSet/Deployment whose pods ``svc`` selects."""
    out = []
    for res in of_kind(resources, "StatefulSet") + of_kind(resources, "Deployment"):
        tmpl = (res.get("spec") or {}).get("template") or {}
        labels = (tmpl.get("metadata") or {}).get("labels") or {}
        if _selects((svc.get("spec") or {}).get("selector"), labels):
            out.append((res, tmpl))
    return out


def _etcd_endpoint_errors(resources: list[dict], w: Workload, host: str, port: int) -> list[str]:
    """inner=etcd-v3/etcd-v2: the endpoint is a Service selecting etcd pods that serve the port
    (with the v2 API on for etcd-v2)."""
    svc_name = host.split(".")[0]
    svcs = [s for s in of_kind(resources, "Service") if name(s) == svc_name]
    if not svcs:
        return [
            f"{w.kind}/{w.name}: etcd endpoint {host}:{port} names Service {svc_name!r}, which is not in the rendering"
        ]
    svc = svcs[0]
    backing = store_pods(resources, svc)
    if not backing:
        return [
            f"Service/{svc_name}: selector {(svc.get('spec') or {}).get('selector')} selects no pods of the rendering"
        ]
    errors = []
    for res, tmpl in backing:
        containers = (tmpl.get("spec") or {}).get("containers") or []
        etcds = [c for c in containers if any("etcd" in str(a) for a in (c.get("command") or [])[:1])]
        if not etcds:
            errors.append(f"{res['kind']}/{name(res)}: pods behind {svc_name} run no etcd")
            continue
        argv = etcds[0].get("command", []) + etcds[0].get("args", [])
        if w.inner == "etcd-v2" and "--enable-v2=true" not in argv:
            errors.append(
                f"{res['kind']}/{name(res)}: etcd without --enable-v2=true: torch's etcd-v2 rendezvous needs the v2 API"
            )
        served = [
            p
            for p in (svc.get("spec") or {}).get("ports") or []
            if p.get("port") == port and _port_number(etcds[0], p.get("targetPort", port)) == port
        ]
        if not served:
            errors.append(f"Service/{svc_name}: no port {port} reaching the etcd container's client port")
    return errors


def rule_replicas(resources: list[dict], w: Workload) -> list[str]:
    errors = []
    if not 1 <= w.min_nodes <= w.max_nodes:
        errors.append(f"{w.kind}/{w.name}: node range {w.min_nodes}:{w.max_nodes} must satisfy 1 <= min <= max")
    if not w.min_nodes <= w.replicas <= w.max_nodes:
        errors.append(f"{w.kind}/{w.name}: replicas={w.replicas} outside the node range [{w.min_nodes}, {w.max_nodes}]")
    if w.kind == "Job":
        spec = next(j for j in of_kind(resources, "Job"))["spec"]
        if spec.get("completionMode") != "Indexed":
            errors.append(f"Job/{w.name}: completionMode must be Indexed (pods need stable hostnames <job>-<i>)")
        if spec.get("completions") != w.replicas:
            errors.append(
                f"Job/{w.name}: completions={spec.get('completions')} must equal parallelism={w.replicas} "
                f"(one index per node)"
            )
    for pdb in of_kind(resources, "PodDisruptionBudget"):
        if not _selects((pdb.get("spec") or {}).get("selector"), w.pod_labels):
            continue  # another component's budget (the etcd store's); rule_policies checks the job has one
        ma = (pdb.get("spec") or {}).get("minAvailable")
        if ma != w.min_nodes:
            errors.append(
                f"PodDisruptionBudget/{name(pdb)}: minAvailable={ma!r} must equal the minimum node count {w.min_nodes}"
            )
    return errors


def _console_scripts() -> set[str]:
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(data.get("project", {}).get("scripts", {}))


def dockerfile_facts(dockerfile: Path = REPO / "Dockerfile") -> dict:
    """What the runtime image provides, read from the Dockerfile (no image is built here)."""
    text = dockerfile.read_text()
    joined = re.sub(r"\\\n", " ", text)
    runs = [ln[4:] for ln in joined.splitlines() if ln.startswith("RUN ")]
    copies = [ln.split()[1:] for ln in joined.splitlines() if ln.startswith("COPY ")]
    installs_project = any("uv pip install" in r and re.search(r"\s/src(\s|$|\[)", r + " ") for r in runs)
    installs_torch = any("uv pip install" in r and "torch==" in r for r in runs)
    path_has_venv = any(ln.startswith("ENV ") and "PATH=/opt/venv/bin" in ln for ln in joined.splitlines())
    app_copies = {}
    for args in copies:
        args = [a for a in args if not a.startswith("--")]
        if len(args) == 2:
            app_copies[args[1].rstrip("/")] = args[0].rstrip("/")
    users = [ln.split()[1] for ln in joined.splitlines() if ln.startswith("USER ")]
    return {
        "installs_project": installs_project,
        "installs_torch": installs_torch,
        "path_has_venv": path_has_venv,
        "copies": app_copies,
        "user": users[-1] if users else None,
    }


def image_has_command(argv: list[str], facts: dict) -> str | None:
    """None when the image can run ``argv[0]`` (and, for our CLI, the subcommand); else why not."""
    if not argv:
        return "empty command"
    exe = argv[0]
    if not facts["path_has_venv"]:
        return "the Dockerfile does not put /opt/venv/bin on PATH"
    if exe == "torchrun":
        return None if facts["installs_torch"] else "the Dockerfile does not install torch (torchrun)"
    if exe in _console_scripts():
        if not facts["installs_project"]:
            return f"{exe!r} is this project's console script, but the Dockerfile does not install the project"
        from elastic_emb.cli.main import main

        sub = argv[1] if len(argv) > 1 else None
        if sub not in main.commands:
            return f"`{exe} {sub}`: no such subcommand (have {sorted(main.commands)})"
        # Parse the options exactly as the CLI would, without running the command.
        try:
            main.commands[sub].make_context(sub, list(argv[2:]), resilient_parsing=False)
        except Exception as exc:  # click.UsageError and friends
            return f"`{shlex.join(argv)}`: {exc}"
        return None
    return f"{exe!r} is neither torchrun nor a console script of this project"


def rule_commands(resources: list[dict], w: Workload, facts: dict | None = None) -> list[str]:
    """The main command and the preStop hook exist in the image; the backend is elastic_emb."""
    facts = facts or dockerfile_facts()
    c = _container(w.pod_template)
    errors = []
    cmd = list(c.get("command") or [])
    why = image_has_command(cmd, facts)
    if why:
        errors.append(f"{w.kind}/{w.name} command: {why}")
    backend = None
    for arg in cmd:
        if arg.startswith("--rdzv-backend="):
            backend = arg.split("=", 1)[1]
    backend = backend or w.rdzv_backend
    if backend != "elastic_emb":
        errors.append(f"{w.kind}/{w.name}: rendezvous backend {backend!r} must be elastic_emb")
    if w.kind == "PyTorchJob" and w.rdzv_backend not in (None, "elastic_emb"):
        errors.append(f"PyTorchJob/{w.name}: elasticPolicy.rdzvBackend={w.rdzv_backend!r} contradicts the command")
    scripts = [a for a in cmd[1:] if a.endswith(".py")]
    for script in scripts:
        src = None
        for dest, source in facts["copies"].items():
            if script.startswith(dest + "/"):
                src = REPO / source / script[len(dest) + 1 :]
        if src is None:
            errors.append(f"{w.kind}/{w.name}: script {script} is not under any directory the Dockerfile copies")
        elif not src.exists():
            errors.append(
                f"{w.kind}/{w.name}: script {script} comes from {src.relative_to(REPO)}, which does not exist"
            )
    # The root filesystem is read-only: whatever the script writes must go to a mounted volume.
    mounts = [m.get("mountPath", "").rstrip("/") for m in c.get("volumeMounts") or []]
    for flag, value in zip(cmd, cmd[1:], strict=False):
        if flag == "--out" and not any(value == m or value.startswith(m + "/") for m in mounts):
            errors.append(
                f"{w.kind}/{w.name}: --out {value} is not on a mounted volume (the root filesystem is read-only)"
            )
    pre = (((c.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")
    if not pre:
        errors.append(f"{w.kind}/{w.name}: container {CONTAINER!r} has no preStop exec hook (the drain)")
    else:
        why = image_has_command(list(pre), facts)
        if why:
            errors.append(f"{w.kind}/{w.name} preStop: {why}")
        elif pre[:2] != ["elastic-emb", "drain"]:
            errors.append(f"{w.kind}/{w.name} preStop: {shlex.join(pre)} is not `elastic-emb drain`")
    return errors


def drain_timeout(pre: list[str]) -> float:
    from elastic_emb.cli.main import main

    ctx = main.commands["drain"].make_context("drain", list(pre[2:]))
    return float(ctx.params["timeout"])


def rule_grace(resources: list[dict], w: Workload) -> list[str]:
    c = _container(w.pod_template)
    pre = (((c.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command") or []
    if pre[:2] != ["elastic-emb", "drain"]:
        return []  # rule_commands reports it
    grace = (w.pod_template.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
    need = drain_timeout(pre) + DRAIN_MARGIN_S
    if grace < need:
        return [
            f"{w.kind}/{w.name}: terminationGracePeriodSeconds={grace} must be >= drain timeout + "
            f"{DRAIN_MARGIN_S} s = {need:g} (kubelet kills the pod at the grace period, drain or not)"
        ]
    return []


def _quantity(q: Any) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    s = str(q)
    for u, f in units.items():
        if s.endswith(u):
            return float(s[: -len(u)]) * f
    return float(s)


def rule_volumes(resources: list[dict], w: Workload) -> list[str]:
    """/dev/shm: a sized Memory emptyDir within the memory limit, holding ELASTIC_EMB_STATE_DIR;
    the durable tier: a PVC that exists, mounted at ELASTIC_EMB_DURABLE_DIR."""
    spec = w.pod_template.get("spec") or {}
    c = _container(w.pod_template)
    vols = {v.get("name"): v for v in spec.get("volumes") or []}
    mounts = {m.get("mountPath"): m.get("name") for m in c.get("volumeMounts") or []}
    errors = []
    shm = vols.get(mounts.get("/dev/shm"))
    if shm is None:
        errors.append(f"{w.kind}/{w.name}: nothing is mounted at /dev/shm (the node-local snapshot tier)")
    else:
        ed = shm.get("emptyDir") or {}
        if ed.get("medium") != "Memory" or not ed.get("sizeLimit"):
            errors.append(
                f"{w.kind}/{w.name}: /dev/shm must be an emptyDir with medium Memory and a sizeLimit, got {shm}"
            )
        else:
            limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
            if limit is None or _quantity(ed["sizeLimit"]) >= _quantity(limit):
                errors.append(
                    f"{w.kind}/{w.name}: /dev/shm sizeLimit {ed['sizeLimit']} must be below the memory "
                    f"limit {limit} (a Memory emptyDir counts against it)"
                )
    state = _env_value(c, "ELASTIC_EMB_STATE_DIR")
    if not state or not (state == "/dev/shm" or state.startswith("/dev/shm/")):
        errors.append(f"{w.kind}/{w.name}: ELASTIC_EMB_STATE_DIR={state!r} must lie under /dev/shm")
    durable = _env_value(c, "ELASTIC_EMB_DURABLE_DIR")
    vol = vols.get(mounts.get(durable)) if durable else None
    claim = ((vol or {}).get("persistentVolumeClaim") or {}).get("claimName")
    if not claim:
        errors.append(
            f"{w.kind}/{w.name}: ELASTIC_EMB_DURABLE_DIR={durable!r} must be the mount path of a "
            f"persistentVolumeClaim volume"
        )
    elif claim not in {name(p) for p in of_kind(resources, "PersistentVolumeClaim")}:
        errors.append(f"{w.kind}/{w.name}: PVC {claim!r} is not in the rendering")
    return errors


def rule_gpus(resources: list[dict], w: Workload) -> list[str]:
    """GPUs requested = workers per node; the CPU variant (ELASTIC_EMB_BACKEND=gloo) asks none."""
    c = _container(w.pod_template)
    res = c.get("resources") or {}
    asked = {k: (res.get(k) or {}).get("nvidia.com/gpu") for k in ("limits", "requests")}
    if _env_value(c, "ELASTIC_EMB_BACKEND") == "gloo":
        if any(v is not None for v in asked.values()):
            return [
                f"{w.kind}/{w.name}: the CPU variant (ELASTIC_EMB_BACKEND=gloo) requests nvidia.com/gpu "
                f"{asked}: a CPU job must not hold GPUs (nor wait for nodes that have them)"
            ]
        return []
    gpus = asked["limits"]
    if not isinstance(gpus, int) or gpus < 1:
        return [f"{w.kind}/{w.name}: limits nvidia.com/gpu={gpus!r} must be a positive integer"]
    if str(w.nproc) != str(gpus):
        return [f"{w.kind}/{w.name}: workers per node {w.nproc!r} must equal nvidia.com/gpu={gpus} (one rank per GPU)"]
    return []


def _rules_ports(rules: list[dict], key: str, labels: dict[str, str]) -> list[tuple[int, int]]:
    """TCP port ranges that ingress (key ``from``) or egress (``to``) rules open to pods with
    ``labels``; a rule without ports opens every port."""
    out = []
    for rule in rules or []:
        peers = rule.get(key) or []
        if peers and not any(set(p) == {"podSelector"} and _selects(p["podSelector"], labels) for p in peers):
            continue
        ports = rule.get("ports")
        if not ports:
            out.append((1, 65535))
        for p in ports or []:
            if p.get("protocol", "TCP") != "TCP":
                continue
            if p.get("port") is None:
                out.append((1, 65535))
            elif isinstance(p.get("port"), int):
                out.append((p["port"], p.get("endPort", p["port"])))
    return out


def _admitted(np_spec: dict, peer_labels: dict[str, str]) -> list[tuple[int, int]]:
    """Port ranges a NetworkPolicy opens to pods with ``peer_labels`` (ingress)."""
    return _rules_ports(np_spec.get("ingress") or [], "from", peer_labels)


def _covers(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
    return any(a <= lo and hi <= b for a, b in ranges)


def port_range(w: Workload) -> tuple[int, int] | None:
    """The pods' ephemeral range (the ip_local_port_range sysctl), or Linux's default when unset."""
    for sc in (w.pod_template.get("spec") or {}).get("securityContext", {}).get("sysctls") or []:
        if sc.get("name") == PORT_RANGE_SYSCTL:
            parts = str(sc.get("value", "")).split()
            if len(parts) == 2 and all(p.isdigit() for p in parts):
                return int(parts[0]), int(parts[1])
            return None
    return EPHEMERAL


def _is_dns_peer(peer: dict) -> bool:
    ns = (peer.get("namespaceSelector") or {}).get("matchLabels") or {}
    pods = (peer.get("podSelector") or {}).get("matchLabels") or {}
    return ns == {"kubernetes.io/metadata.name": "kube-system"} and pods == {"k8s-app": "kube-dns"}


def rule_policies(resources: list[dict], w: Workload) -> list[str]:
    """NetworkPolicy and PodDisruptionBudget select the job's pods; the policy selects them by the
    job-name label their controller sets (not only component labels any pod could copy); ingress
    only from the job's own pods (or the store's members), on the rendezvous port and the pods'
    ephemeral range; egress only to the job's pods (same ports), the store's client port and DNS;
    with an etcd rendezvous the store's pods are isolated the same way."""
    errors = []
    pdbs = [
        p
        for p in of_kind(resources, "PodDisruptionBudget")
        if _selects((p.get("spec") or {}).get("selector"), w.pod_labels)
    ]
    if not pdbs:
        errors.append("no PodDisruptionBudget in the rendering selects the job's pods")
    nps = of_kind(resources, "NetworkPolicy")
    job_nps = [n for n in nps if _selects((n.get("spec") or {}).get("podSelector"), w.pod_labels)]
    if not job_nps:
        errors.append(
            f"no NetworkPolicy in the rendering selects the job's pods ({w.pod_labels}): "
            f"{[name(n) for n in nps] or 'none at all'}"
        )
    port = int(w.endpoint.rpartition(":")[2]) if w.endpoint and w.endpoint.rpartition(":")[2].isdigit() else None
    job_label = JOB_NAME_LABELS[w.kind]
    store_labels = [
        ((t.get("metadata") or {}).get("labels") or {})
        for _, t in [x for svc in of_kind(resources, "Service") for x in store_pods(resources, svc)]
    ]
    for np_ in nps:
        spec = np_.get("spec") or {}
        selected = spec.get("podSelector") or {}
        own = selected.get("matchLabels") or {}
        types = spec.get("policyTypes") or []
        if "Ingress" not in types or "Egress" not in types:
            errors.append(f"NetworkPolicy/{name(np_)}: policyTypes {types} must include Ingress and Egress")
        for rule in spec.get("ingress") or []:
            peers = rule.get("from") or []
            if not peers:
                errors.append(f"NetworkPolicy/{name(np_)}: an ingress rule without `from` admits every source")
            for peer in peers:
                ok = set(peer) == {"podSelector"} and (
                    _selects(peer["podSelector"], w.pod_labels) or _selects(peer["podSelector"], own)
                )
                if not ok:
                    errors.append(f"NetworkPolicy/{name(np_)}: ingress peer {peer} is not (only) the job's own pods")
                elif (
                    _selects(peer["podSelector"], w.pod_labels)
                    and (peer["podSelector"].get("matchLabels") or {}).get(job_label) != w.name
                ):
                    errors.append(
                        f"NetworkPolicy/{name(np_)}: ingress peer {peer} admits the trainer pods by component "
                        f"labels alone; add {job_label}: {w.name} (set by the controller, unique to this job)"
                    )
        for rule in spec.get("egress") or []:
            peers = rule.get("to") or []
            if not peers:
                errors.append(f"NetworkPolicy/{name(np_)}: an egress rule without `to` reaches every destination")
            for peer in peers:
                ok = _is_dns_peer(peer) or (
                    set(peer) == {"podSelector"}
                    and (
                        _selects(peer["podSelector"], w.pod_labels)
                        or _selects(peer["podSelector"], own)
                        or any(_selects(peer["podSelector"], lb) for lb in store_labels)
                    )
                )
                if not ok:
                    errors.append(
                        f"NetworkPolicy/{name(np_)}: egress peer {peer} is neither the job's pods, the "
                        f"rendezvous store nor DNS"
                    )
        if not any(
            _is_dns_peer(p) and {"protocol": "UDP", "port": 53} in (r.get("ports") or [])
            for r in spec.get("egress") or []
            for p in r.get("to") or []
        ):
            errors.append(
                f"NetworkPolicy/{name(np_)}: no egress to DNS (kube-dns, UDP 53): the pods could not "
                f"resolve the rendezvous endpoint"
            )
    span = port_range(w)
    if span is None:
        errors.append(f"{w.kind}/{w.name}: sysctl {PORT_RANGE_SYSCTL} is not two port numbers")
    for np_ in job_nps:
        spec = np_["spec"]
        if (spec.get("podSelector", {}).get("matchLabels") or {}).get(job_label) != w.name:
            errors.append(
                f"NetworkPolicy/{name(np_)}: podSelector lacks {job_label}: {w.name}, the label the "
                f"controller sets on this job's pods (component labels alone match other jobs' pods)"
            )
        for way, rules, key in (("ingress from", spec.get("ingress"), "from"), ("egress to", spec.get("egress"), "to")):
            open_ports = _rules_ports(rules or [], key, w.pod_labels)
            if w.inner == "c10d" and port is not None and not _covers(open_ports, port, port):
                errors.append(f"NetworkPolicy/{name(np_)}: the rendezvous port {port} is not open {way} the job's pods")
            if span is not None and not _covers(open_ports, *span):
                errors.append(
                    f"NetworkPolicy/{name(np_)}: the pods' ephemeral range {span[0]}-{span[1]} "
                    f"({PORT_RANGE_SYSCTL}: store on MASTER_PORT, gloo/NCCL sockets) is not open {way} "
                    f"the job's pods"
                )
    if w.inner.startswith("etcd-") and port is not None and w.endpoint:
        svc_name = w.endpoint.rpartition(":")[0].split(".")[0]
        for svc in [s for s in of_kind(resources, "Service") if name(s) == svc_name]:
            for res, tmpl in store_pods(resources, svc):
                labels = (tmpl.get("metadata") or {}).get("labels") or {}
                store_nps = [n for n in nps if _selects((n.get("spec") or {}).get("podSelector"), labels)]
                if not store_nps:
                    errors.append(
                        f"{res['kind']}/{name(res)}: no NetworkPolicy isolates the rendezvous store's pods "
                        f"(anyone in the cluster could write the rendezvous state)"
                    )
                elif not any(lo <= port <= hi for n in store_nps for lo, hi in _admitted(n["spec"], w.pod_labels)):
                    errors.append(
                        f"{res['kind']}/{name(res)}: the store's client port {port} is not open to the job's pods"
                    )
                if not any(
                    _covers(_rules_ports(n["spec"].get("egress") or [], "to", labels), port, port) for n in job_nps
                ):
                    errors.append(
                        f"NetworkPolicy/elastic-emb: no egress from the job's pods to the store's client port {port}"
                    )
    return errors


# What each inner backend accepts in --rdzv-conf, besides elastic_emb's own keys: torch's dynamic
# rendezvous keys, then the backend's (torch's c10d and etcd-v2 create_backend; etcd_v3.CONF_KEYS).
TORCH_DYNAMIC_KEYS = frozenset(
    {
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "heartbeat_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
    }
)
BACKEND_KEYS = {
    "c10d": frozenset({"read_timeout", "is_host", "store_type", "timeout"}),
    "etcd-v2": frozenset({"read_timeout", "protocol", "ssl_cert", "ssl_cert_key", "ca_cert"}),
}


def accepted_conf_keys(inner: str) -> frozenset[str]:
    from elastic_emb.rdzv.conf import ListenerConfig

    if inner == "etcd-v3":
        from elastic_emb.rdzv.etcd_v3_client import CONF_KEYS as backend
    else:
        backend = BACKEND_KEYS.get(inner, frozenset())
    return frozenset(ListenerConfig.model_fields) | TORCH_DYNAMIC_KEYS | backend


def rule_rdzv_conf(resources: list[dict], w: Workload) -> list[str]:
    """Every --rdzv-conf key is one the backend accepts (torch ignores unknown keys silently: a
    misspelt timeout would just not apply), and elastic_emb's own keys validate."""
    from elastic_emb.rdzv.conf import ListenerConfig

    keys = accepted_conf_keys(w.inner)
    errors = [
        f"{w.kind}/{w.name}: --rdzv-conf key {k!r} is not one inner={w.inner} accepts (have {sorted(keys)})"
        for k in w.rdzv_conf
        if k not in keys
    ]
    if errors:
        return errors
    try:
        ListenerConfig.from_params(w.rdzv_conf)  # what the agent itself checks at start
    except ValueError as exc:
        errors.append(f"{w.kind}/{w.name}: {exc}")
    if w.inner == "etcd-v3":
        from elastic_emb.rdzv.etcd_v3_client import ClientOptions

        try:
            ClientOptions.from_conf(w.rdzv_conf)
        except ValueError as exc:
            errors.append(f"{w.kind}/{w.name}: {exc}")
    return errors


def rule_completion(resources: list[dict], w: Workload) -> list[str]:
    """The workload completes when training ends on any allowed number of pods, and its restart
    budget covers INCIDENTS incidents that restart every agent (OnFailure counts restarts)."""
    errors = []
    need = INCIDENTS * w.max_nodes
    if w.kind == "Job":
        spec = next(j for j in of_kind(resources, "Job"))["spec"]
        rules = (spec.get("successPolicy") or {}).get("rules") or []
        if not any(r.get("succeededCount") == 1 and "succeededIndexes" not in r for r in rules):
            errors.append(
                f"Job/{w.name}: no successPolicy rule `succeededCount: 1` (any index): with completions="
                f"{spec.get('completions')} a run that ends on fewer pods never completes (the other "
                f"indexes stay Pending)"
            )
        restart = (w.pod_template.get("spec") or {}).get("restartPolicy")
        limit = spec.get("backoffLimit", 6)
        if restart == "OnFailure":
            if spec.get("podFailurePolicy") or spec.get("backoffLimitPerIndex") is not None:
                errors.append(f"Job/{w.name}: podFailurePolicy/backoffLimitPerIndex need restartPolicy Never")
            if not isinstance(limit, int) or limit < need:
                errors.append(
                    f"Job/{w.name}: backoffLimit={limit!r} counts every agent restart under OnFailure; one "
                    f"incident can restart all {w.max_nodes} agents, so it must be >= {INCIDENTS} x "
                    f"maxNodes = {need} (params.restartBudget)"
                )
    else:
        job = next(j for j in of_kind(resources, "PyTorchJob"))
        run = job["spec"].get("runPolicy") or {}
        worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
        limit = run.get("backoffLimit")
        if worker.get("restartPolicy") in ("OnFailure", "Always", "ExitCode") and (
            not isinstance(limit, int) or limit < need
        ):
            errors.append(
                f"PyTorchJob/{w.name}: runPolicy.backoffLimit={limit!r} counts every agent restart; it must "
                f"be >= {INCIDENTS} x maxNodes = {need} (params.restartBudget)"
            )
        if run.get("cleanPodPolicy") not in ("Running", "All"):
            errors.append(
                f"PyTorchJob/{w.name}: runPolicy.cleanPodPolicy={run.get('cleanPodPolicy')!r} leaves the "
                f"pods still Pending or running once the job has finished: use Running"
            )
    return errors


def _flag(argv: list[str], flag: str) -> str | None:
    for a in argv:
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def rule_store(resources: list[dict], w: Workload) -> list[str]:
    """With an etcd rendezvous: an odd number (>= 3) of members, exactly those of --initial-cluster
    (the StatefulSet's stable names under its headless Service), started together, one per node,
    compacting their history; a PodDisruptionBudget that lets a drain take one member at a time
    but never the quorum."""
    if not w.inner.startswith("etcd-"):
        return []
    errors = []
    for sts in of_kind(resources, "StatefulSet"):
        spec = sts.get("spec") or {}
        tmpl = spec.get("template") or {}
        containers = (tmpl.get("spec") or {}).get("containers") or []
        etcd = next((c for c in containers if "etcd" in str((c.get("command") or [""])[0])), None)
        if etcd is None:
            continue
        sname, replicas = name(sts), spec.get("replicas", 1)
        argv = list(etcd.get("command") or []) + list(etcd.get("args") or [])
        if not isinstance(replicas, int) or replicas < 3 or replicas % 2 == 0:
            errors.append(
                f"StatefulSet/{sname}: replicas={replicas!r}: the store needs an odd number >= 3 of members "
                f"so that losing one node keeps a quorum (the single-member variant cannot survive it)"
            )
        cluster = _flag(argv, "--initial-cluster") or ""
        members = [m.partition("=") for m in cluster.split(",") if m]
        svc = spec.get("serviceName")
        want = [
            (f"{sname}-{i}", f"http://{sname}-{i}.{svc}:2380")
            for i in range(replicas if isinstance(replicas, int) else 0)
        ]
        if [(n, u) for n, _, u in members] != want:
            errors.append(
                f"StatefulSet/{sname}: --initial-cluster={cluster!r} must name exactly its {replicas} pods "
                f"{[n for n, _ in want]} at their stable peer URLs under Service {svc!r}"
            )
        headless = [s for s in of_kind(resources, "Service") if name(s) == svc]
        if (
            not headless
            or (headless[0].get("spec") or {}).get("clusterIP") != "None"
            or not (headless[0].get("spec") or {}).get("publishNotReadyAddresses")
        ):
            errors.append(
                f"StatefulSet/{sname}: serviceName {svc!r} must be a headless Service with "
                f"publishNotReadyAddresses (members resolve each other before any is ready)"
            )
        if replicas != 1 and spec.get("podManagementPolicy") != "Parallel":
            errors.append(
                f"StatefulSet/{sname}: podManagementPolicy must be Parallel: no member is ready before a "
                f"quorum exists, so an ordered start waits forever"
            )
        anti = ((tmpl.get("spec") or {}).get("affinity") or {}).get("podAntiAffinity") or {}
        labels = (tmpl.get("metadata") or {}).get("labels") or {}
        if not any(
            t.get("topologyKey") == "kubernetes.io/hostname" and _selects(t.get("labelSelector"), labels)
            for t in anti.get("requiredDuringSchedulingIgnoredDuringExecution") or []
        ):
            errors.append(
                f"StatefulSet/{sname}: no required podAntiAffinity on kubernetes.io/hostname: two members on "
                f"one node would both be lost with it"
            )
        if _flag(argv, "--auto-compaction-retention") is None:
            errors.append(
                f"StatefulSet/{sname}: no --auto-compaction-retention: every heartbeat writes a revision "
                f"and the uncompacted history fills etcd's quota"
            )
        pdbs = [
            p
            for p in of_kind(resources, "PodDisruptionBudget")
            if _selects((p.get("spec") or {}).get("selector"), labels)
        ]
        if len(pdbs) != 1:
            errors.append(f"StatefulSet/{sname}: {len(pdbs)} PodDisruptionBudgets select its pods, want 1")
            continue
        pspec = pdbs[0]["spec"]
        quorum = replicas // 2 + 1 if isinstance(replicas, int) else 1
        if "maxUnavailable" in pspec:
            allowed = pspec["maxUnavailable"]
        else:
            allowed = replicas - pspec.get("minAvailable", replicas) if isinstance(replicas, int) else 0
        if not isinstance(allowed, int) or allowed < 1:
            errors.append(
                f"PodDisruptionBudget/{name(pdbs[0])}: allows {allowed!r} disruptions of the store: a "
                f"`kubectl drain` of a member's node would block forever (use maxUnavailable: 1)"
            )
        elif isinstance(replicas, int) and replicas - allowed < quorum:
            errors.append(
                f"PodDisruptionBudget/{name(pdbs[0])}: allows {allowed} of {replicas} members down at once, "
                f"below the quorum of {quorum}"
            )
    return errors


def rule_secret(resources: list[dict], w: Workload) -> list[str]:
    """ELASTIC_EMB_JOB_SECRET comes from a Secret (never a literal in the template), and is required:
    a pod that starts without it would accept unsigned control writes from anyone on the store."""
    c = _container(w.pod_template)
    entries = [e for e in c.get("env") or [] if e.get("name") == "ELASTIC_EMB_JOB_SECRET"]
    where = f"{w.kind}/{w.name}"
    if not entries:
        return [f"{where}: ELASTIC_EMB_JOB_SECRET is not set: control keys would be unsigned (see README, trust model)"]
    ref = ((entries[-1].get("valueFrom") or {}).get("secretKeyRef")) or {}
    if "value" in entries[-1] or not ref.get("name") or not ref.get("key"):
        return [f"{where}: ELASTIC_EMB_JOB_SECRET must come from a secretKeyRef (name and key), not a literal value"]
    if ref.get("optional"):
        return [
            f"{where}: ELASTIC_EMB_JOB_SECRET's secretKeyRef must not be optional: a missing Secret would "
            f"start the job unsigned"
        ]
    return []


WIRING_RULES = {
    "endpoint": rule_endpoint,
    "replicas": rule_replicas,
    "commands": rule_commands,
    "grace": rule_grace,
    "volumes": rule_volumes,
    "gpus": rule_gpus,
    "policies": rule_policies,
    "rdzv_conf": rule_rdzv_conf,
    "completion": rule_completion,
    "store": rule_store,
    "secret": rule_secret,
}


def wiring_errors(resources: list[dict], only: str | None = None) -> list[str]:
    w = workload(resources)
    errors = []
    for rule_name, rule in WIRING_RULES.items():
        if only is None or only == rule_name:
            errors += rule(resources, w)
    return errors


def hadolint(dockerfile: Path, config: Path = REPO / ".hadolint.yaml", timeout: float = 60.0) -> tuple[int, str]:
    exe = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    proc = subprocess.run(
        [exe, "--no-color", "--config", str(config), str(dockerfile)], capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout + proc.stderr
