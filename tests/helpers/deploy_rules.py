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
   disruption budget that lets a drain take one member but never the quorum; every name a
   resource refers to (Services, Secrets, PVCs, label selectors) exists in the rendering and
   belongs to this job, so a ``namePrefix`` keeps two jobs of one namespace apart; every metrics
   port a pod opens is scraped.
4. :func:`field_maturity_errors`: every field the templates use exists in the minimum Kubernetes
   version's schema (:data:`K8S_MIN`, stated in deploy/README.md) and is not alpha or off by
   default there.

Values the pods compute at run time (``$(VAR)`` in env and commands, the downward API) are
resolved as the kubelet resolves them (:func:`pod_env`), for the names the controllers give.

How the training operator turns a PyTorchJob into pods is modelled from its documented
behaviour (v1.9): pods get the labels ``training.kubeflow.org/job-name``, ``replica-type``
(lower case) and ``replica-index``; each replica gets a headless Service
``<job>-<type>-<index>`` selecting exactly that pod and exposing the container port named
``pytorchjob-port``; with an elasticPolicy torchrun gets ``PET_RDZV_ENDPOINT=<rdzvHost or
<job>-worker-0>:<rdzvPort or pytorchjob-port>`` and ``PET_NNODES=<minReplicas>:<maxReplicas>``.
"""

from __future__ import annotations

import json
import os
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
# Kubernetes versions the templates support: from the minimum stated in deploy/README.md (its one
# source; version_statements() finds every other mention, which must agree) to the newest that
# kubernetes-validate knows.
VERSION_FILE = DEPLOY / "README.md"
_MIN_RE = re.compile(r"Minimum: Kubernetes (1\.(\d+)) or newer")
K8S_MIN = _MIN_RE.search(VERSION_FILE.read_text()).group(1) + ".0"
K8S_NEWEST = "1.37.0"
K8S_VERSIONS = tuple(f"1.{m}.0" for m in range(int(K8S_MIN.split(".")[1]), int(K8S_NEWEST.split(".")[1]) + 1))
# Where the supported Kubernetes versions are written for users: each mention must name K8S_MIN.
VERSION_DOCS = ("README.md", "docs/KUBERNETES.md")
CONTAINER = "pytorch"  # the training operator's default container name; the templates use it everywhere
OPERATOR_PORT_NAME = "pytorchjob-port"
OPERATOR_DEFAULT_PORT = 23456
DRAIN_MARGIN_S = 30  # grace period beyond the drain timeout: the commit flush and torchrun's own shutdown
EPHEMERAL = (32768, 60999)  # Linux ip_local_port_range default: MASTER_PORT store, gloo and NCCL sockets
PORT_RANGE_SYSCTL = "net.ipv4.ip_local_port_range"
INCIDENTS = 25  # whole-job incidents (every agent restarted once) the restart budget must cover
JOB_NAME_LABELS = {"Job": "batch.kubernetes.io/job-name", "PyTorchJob": "training.kubeflow.org/job-name"}
INSTANCE_LABEL = "app.kubernetes.io/instance"  # = the job's name on every resource and pod of the job
BASE_NAME = "elastic-emb"  # the templates' job name, before a namePrefix/nameSuffix of the user's
BASE_SECRET = "elastic-emb-job-secret"  # the job's Secret (created by hand), named like the job
WORKERS_ANNOTATION = "elastic-emb.dev/workers-per-node"  # the pods' worker count, for the scrape config
ETCD_V2_LAST_MINOR = (3, 5)  # etcd 3.6 removed the v2 API (and --enable-v2) torch's etcd-v2 needs
ETCD_V3_MIN_MINOR = (3, 6)  # inner=etcd-v3 runs on the current etcd minor
ETCD_DEFAULT_QUOTA = 2 * 2**30  # etcd's backend quota without --quota-backend-bytes


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


def render_variant(
    workdir: Path,
    overlay: str,
    components: tuple[str, ...],
    name_prefix: str | None = None,
    deploy: Path = DEPLOY,
    name_suffix: str | None = None,
) -> list[dict]:
    """An overlay with components of deploy/components added, and a ``namePrefix``/``nameSuffix``
    if given, as a user's kustomization would (written under ``workdir``, outside deploy/)."""
    tag = ((name_prefix or "") + "_" + (name_suffix or "")).strip("-_") or "plain"
    root = Path(workdir) / "-".join((tag, overlay) + components)
    root.mkdir(parents=True, exist_ok=True)
    rel = lambda p: str(Path(os.path.relpath(p, root)))  # noqa: E731
    kust: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [rel(Path(deploy) / overlay)],
        "components": [rel(Path(deploy) / "components" / c) for c in components],
    }
    if name_prefix:
        kust["namePrefix"] = name_prefix
    if name_suffix:
        kust["nameSuffix"] = name_suffix
    (root / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    return render(root)


# -- layer 2a: core kinds through kubernetes-validate -------------------------------------------------


# Custom resources kubernetes-validate has no schema for: each is checked by a schema of ours.
CUSTOM_KINDS = ("PyTorchJob", "PodMonitor")


def core_schema_errors(resources: list[dict], versions: tuple[str, ...] = K8S_VERSIONS) -> list[str]:
    """Strict schema findings for every core resource (and every PyTorchJob pod template)."""
    import kubernetes_validate as kv

    errors = []
    for version in versions:
        for res in resources:
            if res.get("kind") == "PodMonitor":
                continue  # podmonitor_schema_errors
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


# -- layer 4: every field exists, and is usable, in the minimum Kubernetes version ----------------------

# Field descriptions in the API schema say when a field is not generally usable yet: "alpha-level",
# "which is alpha", "(disabled by default)". Beta fields that are on by default pass.
_NOT_USABLE = re.compile(r"alpha-level|\bis alpha\b|which is alpha|disabled by default", re.IGNORECASE)


def _schema_defs(version: str) -> dict:
    import kubernetes_validate

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}-local"
    if not root.is_dir():
        raise ValueError(f"kubernetes-validate has no schema for Kubernetes {version}: install a version that has")
    return json.loads((root / "_definitions.json").read_text())["$defs"]


def _definition_for(defs: dict, api_version: str, kind: str) -> str | None:
    group, _, version = api_version.rpartition("/")
    for name_, schema in defs.items():
        for gvk in schema.get("x-kubernetes-group-version-kind") or []:
            if (gvk.get("group", ""), gvk.get("version"), gvk.get("kind")) == (group, version, kind):
                return name_
    return None


def field_maturity_errors(resources: list[dict], version: str = K8S_MIN) -> list[str]:
    """Fields of the core resources (and the PyTorchJob's pod templates) that Kubernetes ``version``
    does not have, or has only as alpha or off by default (read from its API schema)."""
    defs = _schema_defs(version)
    errors: list[str] = []

    def walk(value: Any, node: dict, where: str) -> None:
        while "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[1]]
        if isinstance(value, dict) and "properties" in node:
            for key, item in value.items():
                prop = node["properties"].get(key)
                if prop is None:
                    errors.append(f"k8s {version}: {where}.{key} does not exist in this version's API")
                    continue
                hit = _NOT_USABLE.search(prop.get("description") or "")
                if hit:
                    errors.append(
                        f"k8s {version}: {where}.{key} is not usable by default in this version "
                        f"(its API description says {hit.group(0)!r}): raise the minimum in "
                        f"{VERSION_FILE.relative_to(REPO)} or drop the field"
                    )
                walk(item, prop, f"{where}.{key}")
        elif isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
            for key, item in value.items():
                walk(item, node["additionalProperties"], f"{where}.{key}")
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            for i, item in enumerate(value):
                walk(item, node["items"], f"{where}[{i}]")

    for res in resources:
        kind = res.get("kind")
        if kind == "PyTorchJob":
            for rtype, spec in ((res.get("spec") or {}).get("pytorchReplicaSpecs") or {}).items():
                walk(
                    (spec or {}).get("template") or {},
                    {"$ref": "#/$defs/io.k8s.api.core.v1.PodTemplateSpec"},
                    f"PyTorchJob/{name(res)} {rtype}.template",
                )
            continue
        if kind in CUSTOM_KINDS:
            continue
        definition = _definition_for(defs, str(res.get("apiVersion")), str(kind))
        if definition is None:
            errors.append(f"k8s {version} has no {res.get('apiVersion')} {kind}")
            continue
        walk({k: v for k, v in res.items() if k != "status"}, defs[definition], f"{kind}/{name(res)}")
    return errors


_VERSION_MENTION = re.compile(r"Kubernetes\s+(?:>=\s*)?(1\.\d+)")


def version_statements() -> list[tuple[str, int, str]]:
    """Every place README.md, docs/KUBERNETES.md and deploy/ name a Kubernetes version, as
    (file, line, "1.NN"); each must be the minimum (K8S_MIN)."""
    files = [REPO / f for f in VERSION_DOCS] + sorted(p for p in DEPLOY.rglob("*") if p.is_file())
    found = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in _VERSION_MENTION.finditer(line):
                found.append((str(path.relative_to(REPO)), lineno, m.group(1)))
    return found


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


# The subset of the Prometheus Operator's monitoring.coreos.com/v1 PodMonitor this project writes
# (field names and enums as in the operator's API types; anything else is rejected).


class RelabelConfig(_Strict):
    action: (
        Literal[
            "replace",
            "keep",
            "drop",
            "hashmod",
            "labelmap",
            "labeldrop",
            "labelkeep",
            "lowercase",
            "uppercase",
            "keepequal",
            "dropequal",
        ]
        | None
    ) = None
    sourceLabels: list[str] | None = None
    separator: str | None = None
    targetLabel: str | None = None
    regex: str | None = None
    replacement: str | None = None
    modulus: int | None = Field(default=None, ge=1)


class PodMetricsEndpoint(_Strict):
    port: str | None = Field(default=None, min_length=1, max_length=15)
    path: str | None = Field(default=None, pattern=r"^/")
    scheme: Literal["http", "https"] | None = None
    interval: str | None = Field(
        default=None,
        pattern=r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
    )
    relabelings: list[RelabelConfig] | None = None


class LabelSelector(_Strict):
    matchLabels: dict[str, str] = Field(min_length=1)


class PodMonitorSpec(_Strict):
    selector: LabelSelector
    podMetricsEndpoints: list[PodMetricsEndpoint] = Field(min_length=1)
    jobLabel: str | None = None
    podTargetLabels: list[str] | None = None


class PodMonitor(_Strict):
    """The subset of monitoring.coreos.com/v1 PodMonitor this project writes."""

    apiVersion: Literal["monitoring.coreos.com/v1"]
    kind: Literal["PodMonitor"]
    metadata: ObjectMeta
    spec: PodMonitorSpec


def podmonitor_schema_errors(monitor: dict) -> list[str]:
    """Schema findings for a PodMonitor, plus relabel regexes that do not compile."""
    try:
        PodMonitor.model_validate(monitor)
    except ValidationError as exc:
        return [f"PodMonitor/{name(monitor)} {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
    errors = []
    for i, ep in enumerate(monitor["spec"]["podMetricsEndpoints"]):
        for j, rc in enumerate(ep.get("relabelings") or []):
            try:
                re.compile(rc.get("regex", "(.*)"))
            except re.error as exc:
                errors.append(f"PodMonitor/{name(monitor)} endpoint {i} relabeling {j}: regex does not compile: {exc}")
    return errors


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
    pod_meta: dict  # pod 0's metadata as the downward API sees it: name, namespace, labels, annotations
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


_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_FIELD_REF = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def _expand(text: str, seen: dict[str, str]) -> str:
    """``$(VAR)`` expanded from ``seen``, as the kubelet does; an unknown reference stays as written."""
    return _VAR_REF.sub(lambda m: seen.get(m.group(1), m.group(0)), str(text))


def _field_ref(path: str, meta: dict | None) -> str | None:
    """A downward-API fieldRef's value for a pod with metadata ``meta`` (None: unknown here)."""
    if meta is None:
        return None
    if path in ("metadata.name", "metadata.namespace"):
        return meta.get(path.split(".", 1)[1])
    m = _FIELD_REF.match(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2))
    return None


def pod_env(container: dict, meta: dict | None = None) -> dict[str, str]:
    """The variables the container sees: values with ``$(VAR)`` expanded only from variables defined
    earlier in the list (as the kubelet does), downward-API fieldRefs from ``meta``. Variables
    whose value is unknown here (a Secret, an unknown fieldRef) are left out."""
    seen: dict[str, str] = {}
    for e in container.get("env") or []:
        if e.get("value") is not None:
            seen[e.get("name")] = _expand(e["value"], seen)
        else:
            ref = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            value = _field_ref(ref, meta) if ref else None
            if value is not None:
                seen[e.get("name")] = value
            else:
                seen.pop(e.get("name"), None)
    return seen


def command_argv(container: dict, meta: dict | None = None) -> list[str]:
    """The container's command and args with ``$(VAR)`` expanded from its environment."""
    env = pod_env(container, meta)
    return [_expand(a, env) for a in list(container.get("command") or []) + list(container.get("args") or [])]


def _env_value(container: dict, key: str, meta: dict | None = None) -> str | None:
    """The value the container sees for ``key`` (see :func:`pod_env`), or None."""
    return pod_env(container, meta).get(key)


def _template_meta(tmpl: dict, name_: str, labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict:
    """A pod's metadata as its controller makes it from ``tmpl``: the template's labels and
    annotations plus the controller's, under the pod name the controller gives."""
    meta = tmpl.get("metadata") or {}
    return {
        "name": name_,
        "namespace": "default",
        "labels": dict(meta.get("labels") or {}, **labels),
        "annotations": dict(meta.get("annotations") or {}, **(annotations or {})),
    }


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
            pod_meta=_template_meta(tmpl, f"{jname}-worker-0", labels),
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
    labels = dict((tmpl.get("metadata") or {}).get("labels") or {})
    labels.update(
        {"batch.kubernetes.io/job-name": jname, "job-name": jname, "batch.kubernetes.io/job-completion-index": "0"}
    )
    meta = _template_meta(tmpl, f"{jname}-0-x7k2p", labels, {"batch.kubernetes.io/job-completion-index": "0"})
    env = pod_env(c, meta)
    lo, hi = _nnodes(env.get("PET_NNODES"))
    return Workload(
        kind="Job",
        name=jname,
        pod_template=tmpl,
        pod_labels=labels,
        pod_meta=meta,
        replicas=spec.get("parallelism", 1),
        min_nodes=lo,
        max_nodes=hi,
        nproc=env.get("PET_NPROC_PER_NODE"),
        endpoint=env.get("PET_RDZV_ENDPOINT"),
        endpoint_services=of_kind(resources, "Service"),
        rdzv_backend=env.get("PET_RDZV_BACKEND"),
        inner=_conf_value(env.get("PET_RDZV_CONF"), "inner") or "c10d",
        rdzv_conf=_conf_items(env.get("PET_RDZV_CONF")),
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
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}
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


def _rule_ranges(rule: dict) -> list[tuple[int, int]]:
    """TCP port ranges one ingress or egress rule opens, whoever its peers are."""
    ports = rule.get("ports")
    if not ports:
        return [(1, 65535)]
    out = []
    for p in ports:
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
    with an etcd rendezvous the store's pods are isolated the same way. The one other peer allowed
    is a metrics scraper, named by namespace and pod labels, on the pods' metrics ports only."""
    errors = []
    try:
        metrics = metrics_ports(w)
    except ValueError:
        metrics = {}  # rule_metrics reports it
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
            if _selects(selected, w.pod_labels) and _scraper_rule(rule, metrics):
                continue  # the metrics scraper (deploy/components/metrics): named pods, metrics ports only
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


def etcd_image_version(image: str) -> tuple[int, int] | None:
    """(major, minor) of an etcd image tag such as ``quay.io/coreos/etcd:v3.6.16``, or None."""
    m = re.search(r":v?(\d+)\.(\d+)(?:\.\d+)?(?:[-+][\w.]*)?$", image or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _member_meta(sts: dict, i: int) -> dict:
    """Member ``i``'s pod metadata: the StatefulSet names its pods <name>-<i>."""
    tmpl = (sts.get("spec") or {}).get("template") or {}
    sname = name(sts)
    return _template_meta(
        tmpl,
        f"{sname}-{i}",
        {"statefulset.kubernetes.io/pod-name": f"{sname}-{i}", "apps.kubernetes.io/pod-index": str(i)},
    )


def rule_store(resources: list[dict], w: Workload) -> list[str]:
    """With an etcd rendezvous: an odd number (>= 3) of members, exactly those of --initial-cluster
    (the StatefulSet's stable names under its headless Service, as each member's command expands
    them), started together, one per node, compacting their history; etcd 3.6 for the v3 API
    (3.5 only for etcd-v2); volumes deleted with the StatefulSet and large enough for the backend
    quota; a PodDisruptionBudget that lets a drain take one member at a time but never the quorum."""
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
        count = replicas if isinstance(replicas, int) else 0
        argvs = [command_argv(etcd, _member_meta(sts, i)) for i in range(max(count, 1))]
        argv = argvs[0]
        if not isinstance(replicas, int) or replicas < 3 or replicas % 2 == 0:
            errors.append(
                f"StatefulSet/{sname}: replicas={replicas!r}: the store needs an odd number >= 3 of members "
                f"so that losing one node keeps a quorum (the single-member variant cannot survive it)"
            )
        cluster = _flag(argv, "--initial-cluster") or ""
        members = [m.partition("=") for m in cluster.split(",") if m]
        svc = spec.get("serviceName")
        want = [(f"{sname}-{i}", f"http://{sname}-{i}.{svc}:2380") for i in range(count)]
        if [(n, u) for n, _, u in members] != want:
            errors.append(
                f"StatefulSet/{sname}: --initial-cluster={cluster!r} must name exactly its {replicas} pods "
                f"{[n for n, _ in want]} at their stable peer URLs under Service {svc!r}"
            )
        for i, member_argv in enumerate(argvs[: len(want)]):
            mine = {
                "--name": want[i][0],
                "--initial-advertise-peer-urls": want[i][1],
                "--advertise-client-urls": f"http://{want[i][0]}.{svc}:2379",
                "--initial-cluster": cluster,
                "--initial-cluster-token": _flag(argv, "--initial-cluster-token"),
            }
            for flag, value in mine.items():
                if _flag(member_argv, flag) != value:
                    errors.append(
                        f"StatefulSet/{sname}: member {want[i][0]} runs with {flag}={_flag(member_argv, flag)!r}, "
                        f"not {value!r} (its own name and URLs, and the same cluster and token as every member)"
                    )
        version = etcd_image_version(etcd.get("image", ""))
        if version is None:
            errors.append(
                f"StatefulSet/{sname}: etcd image {etcd.get('image')!r} has no version tag (vMAJOR.MINOR.PATCH)"
            )
        elif w.inner == "etcd-v2" and version > ETCD_V2_LAST_MINOR:
            errors.append(
                f"StatefulSet/{sname}: inner=etcd-v2 needs the v2 API, which etcd {version[0]}.{version[1]} removed "
                f"(with --enable-v2): use etcd {ETCD_V2_LAST_MINOR[0]}.{ETCD_V2_LAST_MINOR[1]} (deploy/components/etcd-v2)"
            )
        elif w.inner == "etcd-v3" and version < ETCD_V3_MIN_MINOR:
            errors.append(
                f"StatefulSet/{sname}: inner=etcd-v3 runs on etcd {ETCD_V3_MIN_MINOR[0]}.{ETCD_V3_MIN_MINOR[1]} or "
                f"newer, not {etcd.get('image')} ({ETCD_V2_LAST_MINOR[0]}.{ETCD_V2_LAST_MINOR[1]} is for etcd-v2's "
                f"v2 API only)"
            )
        if (spec.get("persistentVolumeClaimRetentionPolicy") or {}).get("whenDeleted") != "Delete":
            errors.append(
                f"StatefulSet/{sname}: persistentVolumeClaimRetentionPolicy.whenDeleted must be Delete, or the "
                f"members' volumes outlive the job (and a new job with the same names would find the old "
                f"cluster's data)"
            )
        quota = int(_flag(argv, "--quota-backend-bytes") or ETCD_DEFAULT_QUOTA)
        for claim in spec.get("volumeClaimTemplates") or []:
            size = ((claim.get("spec") or {}).get("resources") or {}).get("requests", {}).get("storage")
            try:
                ok = _quantity(size) >= 2 * quota
            except (TypeError, ValueError):
                ok = False
            if not ok:
                errors.append(
                    f"StatefulSet/{sname}: volume {name(claim)!r} requests {size!r}, below twice the backend "
                    f"quota ({quota} bytes): the database, its log and a snapshot copy must fit "
                    f"(params.etcdStorage)"
                )
        res = etcd.get("resources") or {}
        for kind_, key in (("requests", "cpu"), ("requests", "memory"), ("limits", "memory")):
            value = (res.get(kind_) or {}).get(key)
            try:
                ok = value is not None and _quantity(value) > 0
            except ValueError:
                ok = False
            if not ok:
                errors.append(
                    f"StatefulSet/{sname}: etcd {kind_}.{key}={value!r} must be set (params.etcdCpu, etcdMemory)"
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


# -- names: every reference resolves inside the rendering, to this job's own resources ---------------


def pod_templates(resources: list[dict], w: Workload) -> list[tuple[str, dict, dict]]:
    """(owner, pod template, pod 0's metadata) of every workload in the rendering, with the labels
    and the name its controller gives the pods."""
    out = [(f"{w.kind}/{w.name}", w.pod_template, w.pod_meta)]
    for sts in of_kind(resources, "StatefulSet"):
        tmpl = (sts.get("spec") or {}).get("template") or {}
        out.append((f"StatefulSet/{name(sts)}", tmpl, _member_meta(sts, 0)))
    return out


def selectors(resources: list[dict]) -> list[tuple[str, dict]]:
    """(where, selector) of every label selector in the rendering that picks pods of this namespace
    (peers with a namespaceSelector pick pods elsewhere and are left out)."""
    out = []
    for res in resources:
        kind, rname, spec = res.get("kind"), name(res), res.get("spec") or {}
        where = f"{kind}/{rname}"
        if kind == "Service" and spec.get("selector"):
            out.append((f"{where} spec.selector", spec["selector"]))
        if kind in ("PodDisruptionBudget", "StatefulSet", "PodMonitor") and spec.get("selector"):
            out.append((f"{where} spec.selector", spec["selector"]))
        if kind == "NetworkPolicy":
            out.append((f"{where} spec.podSelector", spec.get("podSelector") or {}))
            for way, key in (("ingress", "from"), ("egress", "to")):
                for i, rule in enumerate(spec.get(way) or []):
                    for j, peer in enumerate(rule.get(key) or []):
                        if "podSelector" in peer and "namespaceSelector" not in peer:
                            out.append((f"{where} {way}[{i}].{key}[{j}].podSelector", peer["podSelector"]))
        if kind == "StatefulSet":
            anti = (((spec.get("template") or {}).get("spec") or {}).get("affinity") or {}).get("podAntiAffinity") or {}
            for i, term in enumerate(anti.get("requiredDuringSchedulingIgnoredDuringExecution") or []):
                if term.get("labelSelector"):
                    out.append((f"{where} podAntiAffinity[{i}].labelSelector", term["labelSelector"]))
    return out


def _pod_refs(tmpl: dict) -> list[tuple[str, str, str]]:
    """(kind, name, where) of every Secret, ConfigMap and PVC a pod template names."""
    spec = tmpl.get("spec") or {}
    refs = []
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        for e in c.get("env") or []:
            src = e.get("valueFrom") or {}
            for key, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                if (src.get(key) or {}).get("name"):
                    refs.append((kind, src[key]["name"], f"container {c.get('name')} env {e.get('name')}"))
        for e in c.get("envFrom") or []:
            for key, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
                if (e.get(key) or {}).get("name"):
                    refs.append((kind, e[key]["name"], f"container {c.get('name')} envFrom"))
    for v in spec.get("volumes") or []:
        if (v.get("persistentVolumeClaim") or {}).get("claimName"):
            refs.append(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"], f"volume {v.get('name')}"))
        if (v.get("secret") or {}).get("secretName"):
            refs.append(("Secret", v["secret"]["secretName"], f"volume {v.get('name')}"))
        if (v.get("configMap") or {}).get("name"):
            refs.append(("ConfigMap", v["configMap"]["name"], f"volume {v.get('name')}"))
    return refs


def job_secret_name(job: str) -> str:
    """The Secret a job named ``job`` reads: the templates' name with the same prefix and suffix."""
    if BASE_NAME in job:
        pre, _, post = job.partition(BASE_NAME)
        return f"{pre}{BASE_SECRET}{post}"
    return f"{job}-job-secret"


def rule_references(resources: list[dict], w: Workload) -> list[str]:
    """Every name a resource refers to exists in the rendering, and every selector picks this job's
    pods and only them: Secrets, ConfigMaps and PVCs of the pods (the job's Secret, created by
    hand, is named like the job: elastic-emb-job-secret with the job's prefix and suffix); the Services named by pod annotations, subdomains and
    serviceName; label selectors select a pod of the rendering and carry a label whose value is
    the job's name (app.kubernetes.io/instance, or the controller's job-name label), which every
    resource of the job carries too. With these, a namePrefix of your own gives a second job of
    the namespace its own names and its own pods."""
    errors = []
    have = {(r.get("kind"), name(r)) for r in resources}
    services = {name(s) for s in of_kind(resources, "Service")}
    job_secret = job_secret_name(w.name)
    templates = pod_templates(resources, w)
    for owner, tmpl, meta in templates:
        for kind, ref, where in _pod_refs(tmpl):
            if kind == "Secret" and ref == job_secret:
                continue  # created by hand (README: kubectl create secret generic elastic-emb-job-secret)
            if (kind, ref) not in have:
                hint = f" (the job's own Secret is {job_secret!r})" if kind == "Secret" else ""
                errors.append(f"{owner} {where}: {kind} {ref!r} is not in the rendering{hint}")
        annotations = meta.get("annotations") or {}
        for key in ("elastic-emb.dev/rdzv-service", "elastic-emb.dev/peer-service"):
            if key in annotations and annotations[key] not in services:
                errors.append(f"{owner} annotation {key}={annotations[key]!r} names no Service of the rendering")
        if "elastic-emb.dev/statefulset" in annotations and not owner.endswith(
            "/" + annotations["elastic-emb.dev/statefulset"]
        ):
            errors.append(
                f"{owner} annotation elastic-emb.dev/statefulset={annotations['elastic-emb.dev/statefulset']!r} "
                f"is not its own StatefulSet's name"
            )
        subdomain = (tmpl.get("spec") or {}).get("subdomain")
        if subdomain is not None and subdomain not in services:
            errors.append(f"{owner} spec.subdomain {subdomain!r} names no Service of the rendering")
    for sts in of_kind(resources, "StatefulSet"):
        svc = (sts.get("spec") or {}).get("serviceName")
        if svc not in services:
            errors.append(f"StatefulSet/{name(sts)} serviceName {svc!r} names no Service of the rendering")
    # The job's pods, the job's resources: all labelled with the job's name.
    own_values = {w.name}
    for res in resources:
        value = ((res.get("metadata") or {}).get("labels") or {}).get(INSTANCE_LABEL)
        if value is not None and value != w.name:
            errors.append(
                f"{res.get('kind')}/{name(res)}: label {INSTANCE_LABEL}={value!r} is not the job's name {w.name!r}"
            )
    for owner, _, meta in templates:
        value = (meta.get("labels") or {}).get(INSTANCE_LABEL)
        if value != w.name:
            errors.append(f"{owner} pods: label {INSTANCE_LABEL}={value!r} is not the job's name {w.name!r}")
    job_keys = {INSTANCE_LABEL, JOB_NAME_LABELS[w.kind]}
    for where, sel in selectors(resources):
        if not any(_selects(sel, meta.get("labels") or {}) for _, _, meta in templates):
            errors.append(f"{where} {sel} selects no pod of the rendering")
        match = sel.get("matchLabels", sel if "matchExpressions" not in sel else {}) or {}
        if not any(match.get(k) in own_values for k in job_keys):
            errors.append(
                f"{where} {sel} has no label with the job's name ({' or '.join(sorted(job_keys))}: {w.name}): "
                f"it would pick another job's pods in the same namespace"
            )
    return errors


def namespace_clash_errors(renders: list[list[dict]]) -> list[str]:
    """Renderings applied to one namespace (jobs told apart by a namePrefix): no two have a resource
    of the same kind and name, or read the same Secret, and no selector of one picks a pod of
    another (its PDB, Services, NetworkPolicies, PodMonitor and etcd members act on its own pods)."""
    errors = []
    owners: dict[tuple, str] = {}
    jobs = [workload(res) for res in renders]
    pods = [[meta for _, _, meta in pod_templates(res, w)] for res, w in zip(renders, jobs, strict=True)]
    for res, w in zip(renders, jobs, strict=True):
        keys = {(r.get("kind"), name(r)) for r in res}
        keys |= {
            ("Secret", ref) for _, tmpl, _ in pod_templates(res, w) for k, ref, _ in _pod_refs(tmpl) if k == "Secret"
        }
        for key in sorted(keys, key=str):
            if key in owners and owners[key] != w.name:
                errors.append(f"{key[0]}/{key[1]} belongs to both {owners[key]} and {w.name}")
            owners.setdefault(key, w.name)
    for i, (res, w) in enumerate(zip(renders, jobs, strict=True)):
        for where, sel in selectors(res):
            for j, others in enumerate(pods):
                if j != i and any(_selects(sel, m.get("labels") or {}) for m in others):
                    errors.append(f"{w.name}: {where} {sel} also selects pods of {jobs[j].name}")
    return errors


# -- metrics: every port a pod opens is scraped, and reachable ---------------------------------------


def metrics_ports(w: Workload) -> dict[int, str]:
    """Port -> process for every metrics endpoint a pod of the job opens (elastic_emb.metrics: the
    agent on ELASTIC_EMB_METRICS_PORT, the worker of local rank r on that + 1 + r); empty when off."""
    env = pod_env(_container(w.pod_template), w.pod_meta)
    base = env.get("ELASTIC_EMB_METRICS_PORT")
    if base is None:
        return {}
    base_port = int(base)
    ports = {base_port: "agent"}
    for r in range(int(w.nproc or 0)):
        ports[base_port + 1 + r] = f"worker local rank {r}"
    return ports


def _sanitize(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _target_labels(meta: dict, container: dict, port: dict) -> dict[str, str]:
    """The discovery labels Prometheus's kubernetes_sd (role pod) gives one declared container port."""
    out = {
        "__meta_kubernetes_pod_name": meta.get("name", ""),
        "__meta_kubernetes_namespace": meta.get("namespace", ""),
        "__meta_kubernetes_pod_container_name": container.get("name", ""),
        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
        "__meta_kubernetes_pod_container_port_number": str(port.get("containerPort", "")),
        "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP"),
    }
    for k, v in (meta.get("labels") or {}).items():
        out[f"__meta_kubernetes_pod_label_{_sanitize(k)}"] = v
    for k, v in (meta.get("annotations") or {}).items():
        out[f"__meta_kubernetes_pod_annotation_{_sanitize(k)}"] = v
    return out


def _relabel_keeps(labels: dict[str, str], relabelings: list[dict]) -> bool:
    """Whether keep/drop relabelings let a target through (regexes anchored, as Prometheus's are)."""
    for rc in relabelings or []:
        action = (rc.get("action") or "replace").lower()
        if action not in ("keep", "drop"):
            continue
        value = (rc.get("separator") or ";").join(labels.get(s_, "") for s_ in rc.get("sourceLabels") or [])
        hit = re.fullmatch(rc.get("regex", "(.*)"), value) is not None
        if (action == "keep") != hit:
            return False
    return True


def scraped_ports(resources: list[dict], w: Workload) -> dict[int, str]:
    """Port -> what scrapes it, for every target a scrape configuration of the rendering makes on the
    job's pod 0: PodMonitor endpoints (by declared port name, after their keep/drop relabelings)
    and prometheus.io annotations (one port per pod)."""
    c = _container(w.pod_template)
    out: dict[int, str] = {}
    for pm in of_kind(resources, "PodMonitor"):
        spec = pm.get("spec") or {}
        if not _selects(spec.get("selector"), w.pod_labels):
            continue
        for i, ep in enumerate(spec.get("podMetricsEndpoints") or []):
            for port in c.get("ports") or []:
                if ep.get("port") is not None and port.get("name") != ep["port"]:
                    continue
                if _relabel_keeps(_target_labels(w.pod_meta, c, port), ep.get("relabelings") or []):
                    out[port["containerPort"]] = f"PodMonitor/{name(pm)} endpoint {i} ({ep.get('port')})"
    annotations = w.pod_meta.get("annotations") or {}
    if annotations.get("prometheus.io/scrape") == "true" and str(annotations.get("prometheus.io/port", "")).isdigit():
        out[int(annotations["prometheus.io/port"])] = "the prometheus.io annotations"
    return out


def _scraper_rule(rule: dict, metrics: dict[int, str]) -> bool:
    """An ingress rule that admits pods of another namespace (a Prometheus), named by labels, on
    metrics ports only."""
    peers = rule.get("from") or []
    ports = rule.get("ports") or []
    specific = all(
        set(p) == {"namespaceSelector", "podSelector"}
        and (p["namespaceSelector"].get("matchLabels") or {})
        and (p["podSelector"].get("matchLabels") or {})
        for p in peers
    )
    within = all(
        isinstance(p.get("port"), int) and all(q in metrics for q in range(p["port"], p.get("endPort", p["port"]) + 1))
        for p in ports
    )
    return bool(peers) and bool(ports) and bool(metrics) and specific and within


def rule_metrics(resources: list[dict], w: Workload) -> list[str]:
    """Every metrics port a pod opens is scraped (a PodMonitor endpoint per port, or annotations
    naming the one port), no scrape target points at a port nothing listens on, and the job's
    NetworkPolicy admits the scraper on each scraped port."""
    errors = []
    try:
        opened = metrics_ports(w)
    except ValueError as exc:
        return [
            f"{w.kind}/{w.name}: metrics ports cannot be computed ({exc}): ELASTIC_EMB_METRICS_PORT and the workers per node must be integers"
        ]
    scraped = scraped_ports(resources, w)
    missing = {port: what for port, what in sorted(opened.items()) if port not in scraped}
    if missing:
        errors.append(
            f"{w.kind}/{w.name}: metrics ports {sorted(missing)} ({', '.join(missing.values())}) are served but no "
            f"scrape configuration names them (add deploy/components/metrics: a PodMonitor endpoint per port)"
        )
    for port, by in sorted(scraped.items()):
        if port not in opened:
            errors.append(
                f"{by} scrapes port {port} of {w.kind}/{w.name}'s pods, where nothing serves metrics (a target "
                f"always down; workers per node {w.nproc}, annotation {WORKERS_ANNOTATION})"
            )
    c = _container(w.pod_template)
    undeclared = sorted(set(opened) - {p.get("containerPort") for p in c.get("ports") or []})
    if undeclared:
        errors.append(
            f"{w.kind}/{w.name}: metrics ports {undeclared} are not declared on container {CONTAINER!r} (a "
            f"PodMonitor finds a port by its declared name)"
        )
    job_nps = [
        n
        for n in of_kind(resources, "NetworkPolicy")
        if _selects((n.get("spec") or {}).get("podSelector"), w.pod_labels)
    ]
    for port in sorted(set(scraped) & set(opened)):
        if not any(
            _scraper_rule(rule, opened) and _covers(_rule_ranges(rule), port, port)
            for n in job_nps
            for rule in n["spec"].get("ingress") or []
        ):
            errors.append(
                f"NetworkPolicy: no ingress rule admits the scraper (a Prometheus in its namespace) on metrics port "
                f"{port}: the scrape would time out"
            )
    return errors


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
    "references": rule_references,
    "metrics": rule_metrics,
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
