# syntax=docker/dockerfile:1.7
# The elastic_emb training image: torchrun, the `elastic_emb` rendezvous backend, the `elastic-emb`
# CLI (its `drain` subcommand is the pods' preStop hook) and examples/train_recsys.py.
#
#   GPU (default):  docker build -t elastic-emb:0.1.0 .
#   CPU variant:    docker build --build-arg VARIANT=cpu -t elastic-emb:0.1.0-cpu .
#
# Why this shape:
# - Python comes from uv's standalone builds, so the CUDA base (Ubuntu) and the CPU base (Debian)
#   get the same interpreter without distribution packages whose versions we could not pin.
# - Two stages: the builder holds uv and the wheel caches; the runtime stage copies only the
#   interpreter and the virtual environment, owned by root and read-only to the training user.
# - Layers are ordered by how often they change: interpreter, then torch (GBs, changes rarely),
#   then pinned dependencies, then the package, then the example script.
# - Every version is pinned: base image tags, uv, Python, torch (build args) and the dependency
#   lock in deploy/image-constraints.txt.

ARG VARIANT=cuda
ARG CUDA_BASE=nvidia/cuda:13.0.1-base-ubuntu24.04
ARG CPU_BASE=debian:12.12-slim

# One base stage per variant; `FROM base-${VARIANT}` below picks one. TORCH_INDEX is where that
# variant's torch wheel lives (the CUDA wheel bundles the CUDA runtime and NCCL as pip packages;
# the base image contributes the NVIDIA container-toolkit settings and the driver compat libs).
FROM ${CUDA_BASE} AS base-cuda
LABEL org.opencontainers.image.title="elastic-emb" \
      org.opencontainers.image.description="torchrun + elastic_emb: elastic sharded-embedding training" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV TORCH_INDEX=https://download.pytorch.org/whl/cu130 \
    ELASTIC_EMB_BACKEND=nccl

FROM ${CPU_BASE} AS base-cpu
LABEL org.opencontainers.image.title="elastic-emb" \
      org.opencontainers.image.description="torchrun + elastic_emb: elastic sharded-embedding training (CPU)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV TORCH_INDEX=https://download.pytorch.org/whl/cpu \
    ELASTIC_EMB_BACKEND=gloo

# hadolint ignore=DL3006
FROM base-${VARIANT} AS builder
ARG PYTHON_VERSION=3.12.12
ARG TORCH_VERSION=2.11.0
COPY --from=ghcr.io/astral-sh/uv:0.9.5 /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN uv python install "${PYTHON_VERSION}" \
 && uv venv --python "${PYTHON_VERSION}" /opt/venv
COPY deploy/image-constraints.txt /src/deploy/image-constraints.txt
# best-match across the two indexes: torch's local-version wheel (+cu130 / +cpu) sorts above
# PyPI's plain one, and every other package is held to the constraint file anyway.
RUN uv pip install --constraint /src/deploy/image-constraints.txt \
        --index-url "${TORCH_INDEX}" --extra-index-url https://pypi.org/simple \
        --index-strategy unsafe-best-match "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY elastic_emb/ /src/elastic_emb/
RUN uv pip install --constraint /src/deploy/image-constraints.txt /src "python-etcd==0.4.5"

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
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ELASTIC_EMB_LOG_FORMAT=json \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    XDG_CACHE_HOME=/tmp/.cache \
    MPLCONFIGDIR=/tmp/matplotlib
# Caches go to /tmp: the Kubernetes templates mount the root filesystem read-only.
USER 10001:10001
# torchrun reads every other option from PET_* variables (nnodes, nproc-per-node, rdzv endpoint,
# id and conf), which the Kubernetes templates set; the rendezvous backend is fixed here.
ENTRYPOINT ["torchrun", "--rdzv-backend=elastic_emb"]
CMD ["/app/examples/train_recsys.py"]
