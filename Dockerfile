# syntax=docker/dockerfile:1.7
# The elastic_emb training image: torchrun, the `elastic_emb` rendezvous backend, the `elastic-emb`
# CLI (its `drain` subcommand is the pods' preStop hook) and the example model
# (elastic_emb.examples.recsys; /app/examples/train_recsys.py points at it).
#
#   GPU (default):  docker build -t elastic-emb:0.1.0 .
#   CPU variant:    docker build --build-arg VARIANT=cpu -t elastic-emb:0.1.0-cpu .
#
# Every outside source is a build argument whose default is today's public one, so a build behind
# a proxy, from a mirror, or offline substitutes each without editing this file:
#   CUDA_BASE / CPU_BASE   base images (any registry or a local image)
#   UV_IMAGE               an image holding the uv binary at /uv
#   PYTHON_SOURCE          uv: uv's standalone CPython (fetched from PYTHON_MIRROR, default GitHub);
#                          base: the base image's own python3 (PYTHON_VERSION is then ignored)
#   TORCH_INDEX            the torch wheel index; empty: the variant's (download.pytorch.org cu130 / cpu)
#   PYPI_INDEX, EXTRA_INDEXES   where every other package comes from (EXTRA_INDEXES: space-separated)
# uv uses the system's CA store (UV_NATIVE_TLS), so a TLS-inspecting proxy's CA, once installed in
# the base image, is trusted. `make image-check` builds the CPU variant with local stand-ins for all
# of these (docs/KUBERNETES.md).
#
# Why this shape:
# - Two stages: the builder holds uv; the runtime stage copies only the interpreter and the
#   virtual environment, owned by root and read-only to the training user.
# - Layers are ordered by how often they change: interpreter, then torch (GBs, changes rarely),
#   then pinned dependencies, then the package, then the example pointer.
# - Every version is pinned: base image tags, uv, Python, torch (build args) and the dependency
#   lock in deploy/image-constraints.txt.
# - The CUDA runtime can compile Triton's launcher (gcc, libc headers) and Triton's cache is under
#   /tmp (the root filesystem is read-only in the templates), so the Triton gather kernel is used.

ARG VARIANT=cuda
ARG CUDA_BASE=nvidia/cuda:13.0.1-base-ubuntu24.04
ARG CPU_BASE=debian:12.12-slim
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.9.5

# hadolint ignore=DL3006
FROM ${UV_IMAGE} AS uv

# One base stage per variant; `FROM base-${VARIANT}` below picks one. DEFAULT_TORCH_INDEX is where
# that variant's torch wheel lives (the CUDA wheel bundles the CUDA runtime and NCCL as pip
# packages; the base image contributes the NVIDIA container-toolkit settings and the driver libs).
FROM ${CUDA_BASE} AS base-cuda
LABEL org.opencontainers.image.title="elastic-emb" \
      org.opencontainers.image.description="torchrun + elastic_emb: elastic sharded-embedding training" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEFAULT_TORCH_INDEX=https://download.pytorch.org/whl/cu130 \
    ELASTIC_EMB_BACKEND=nccl
# Triton (torch's GPU kernel compiler, used by elastic_emb's gather kernel) builds a small C
# launcher at first use: it needs a C compiler and libc headers at run time.
# (DL3008 ignored: gcc and libc6-dev must match the base image's libc6, which its tag pins.)
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

FROM ${CPU_BASE} AS base-cpu
LABEL org.opencontainers.image.title="elastic-emb" \
      org.opencontainers.image.description="torchrun + elastic_emb: elastic sharded-embedding training (CPU)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEFAULT_TORCH_INDEX=https://download.pytorch.org/whl/cpu \
    ELASTIC_EMB_BACKEND=gloo

# hadolint ignore=DL3006
FROM base-${VARIANT} AS builder
ARG PYTHON_SOURCE=uv
ARG PYTHON_VERSION=3.12.12
ARG PYTHON_MIRROR=
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=
ARG PYPI_INDEX=https://pypi.org/simple
ARG EXTRA_INDEXES=
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NATIVE_TLS=1 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN set -eu; mkdir -p /opt/python; \
    case "${PYTHON_SOURCE}" in \
      uv)   UV_PYTHON_INSTALL_MIRROR="${PYTHON_MIRROR}" uv python install "${PYTHON_VERSION}"; \
            uv venv --python "${PYTHON_VERSION}" --python-preference only-managed /opt/venv ;; \
      base) uv venv --python /usr/bin/python3 --python-preference only-system /opt/venv ;; \
      *)    echo "PYTHON_SOURCE=${PYTHON_SOURCE}: use uv or base" >&2; exit 2 ;; \
    esac
COPY deploy/image-constraints.txt /src/deploy/image-constraints.txt
# best-match across the indexes: torch's local-version wheel (+cu130 / +cpu) sorts above PyPI's
# plain one, and every other package is held to the constraint file anyway. (SC2086: ${extra} is
# split into options on purpose.)
# hadolint ignore=SC2086
RUN set -eu; extra=""; for i in ${EXTRA_INDEXES}; do extra="${extra} --extra-index-url ${i}"; done; \
    uv pip install --constraint /src/deploy/image-constraints.txt \
        --index-url "${TORCH_INDEX:-${DEFAULT_TORCH_INDEX}}" --extra-index-url "${PYPI_INDEX}" ${extra} \
        --index-strategy unsafe-best-match "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md LICENSE /src/
COPY elastic_emb/ /src/elastic_emb/
# (the project with its [drill], [etcd-v2] and [metrics] extras, versions from the constraint file;
# uv takes extras from a pyproject.toml requirements source)
# hadolint ignore=SC2086
RUN set -eu; extra=""; for i in ${EXTRA_INDEXES}; do extra="${extra} --extra-index-url ${i}"; done; \
    uv pip install --constraint /src/deploy/image-constraints.txt --index-url "${PYPI_INDEX}" ${extra} \
        -r /src/pyproject.toml --extra drill --extra etcd-v2 --extra metrics /src

# (DL3006 ignored on purpose: `base-${VARIANT}` names a stage above, whose images are tagged.)
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
# Labelled again here (hadolint checks each stage; the values repeat the base stage's).
LABEL org.opencontainers.image.title="elastic-emb" \
      org.opencontainers.image.description="torchrun + elastic_emb: elastic sharded-embedding training" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ARG APP_UID=10001
# A fixed numeric uid/gid so Kubernetes' runAsNonRoot can verify it and volumes can be chowned
# by fsGroup; no login shell, no home directory contents.
RUN groupadd --system --gid "${APP_UID}" elastic \
 && useradd --system --uid "${APP_UID}" --gid "${APP_UID}" --home-dir /app --no-create-home \
        --shell /usr/sbin/nologin elastic
COPY --from=builder /opt/python /opt/python
COPY --from=builder /opt/venv /opt/venv
COPY --chown=root:root examples/ /app/examples/
WORKDIR /app
# Caches go to /tmp: the Kubernetes templates mount the root filesystem read-only.
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ELASTIC_EMB_LOG_FORMAT=json \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/triton \
    MPLCONFIGDIR=/tmp/matplotlib
USER 10001:10001
# torchrun reads every other option from PET_* variables (nnodes, nproc-per-node, rdzv endpoint,
# id and conf), which the Kubernetes templates set; the rendezvous backend is fixed here.
ENTRYPOINT ["torchrun", "--rdzv-backend=elastic_emb"]
CMD ["/app/examples/train_recsys.py"]
