# syntax=docker/dockerfile:1
# Two images from one file. `make images` builds both with buildah; Docker works as well:
#   docker build --target operator -t pagekeeper-operator:0.1.0 .   (slim Python, no torch)
#   docker build --target engine   -t pagekeeper-engine:0.1.0 .     (CUDA PyTorch base)
# Build arguments:
#   PYTHON_IMAGE  base of the operator image: Python >= 3.11 with pip, useradd and groupadd
#   TORCH_IMAGE   base of the engine image: the same, with PyTorch >= 2.4 installed
#   UID           numeric user and group both images run as (default 10001)
#   VERSION, REVISION, SOURCE  the OCI labels: version, commit, repository address (`make images`
#                 passes all three)
# Both images run as UID on a read-only root filesystem: the operator writes only under /tmp;
# the engine writes only under $HOME (/tmp), where its Triton, Inductor and Hugging Face caches
# go unless the pod points them elsewhere (docs/development.md, "Images").
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG TORCH_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

# ---- operator -------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator
ARG UID=10001
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore HOME=/tmp
RUN groupadd --gid "${UID}" pagekeeper \
 && useradd --uid "${UID}" --gid "${UID}" --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin pagekeeper
WORKDIR /src
# The build tools and the `operator` extra, read from pyproject.toml alone: a change of code
# reuses this layer. The project's own dependencies are ranges, not pins (DL3013).
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
print('\n'.join(p['build-system']['requires'] + p['project']['optional-dependencies']['operator']))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY README.md ./
COPY operator/ operator/
COPY memplan/ memplan/
# hadolint ignore=DL3013
RUN pip install --no-deps --no-build-isolation . && rm -rf /src
WORKDIR /
USER ${UID}:${UID}
# Settings come from PAGEKEEPER_* environment variables (docs/operator.md).
ENTRYPOINT ["kopf", "run", "--module", "pagekeeper_operator.main"]
CMD ["--all-namespaces"]
# Last, so that a new commit changes only the image's configuration.
ARG VERSION
ARG REVISION
ARG SOURCE
LABEL org.opencontainers.image.title="pagekeeper-operator" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"

# ---- engine ---------------------------------------------------------------------------------
FROM ${TORCH_IMAGE} AS engine
ARG UID=10001
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore HOME=/tmp
RUN groupadd --gid "${UID}" pagekeeper \
 && useradd --uid "${UID}" --gid "${UID}" --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin pagekeeper
WORKDIR /src
# As above, with the `engine` extra; torch is kept from the base image, which satisfies it.
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
print('\n'.join(p['build-system']['requires'] + p['project']['optional-dependencies']['engine']))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY README.md ./
COPY engine/ engine/
COPY memplan/ memplan/
# hadolint ignore=DL3013
RUN pip install --no-deps --no-build-isolation . && rm -rf /src
WORKDIR /
USER ${UID}:${UID}
EXPOSE 8000
ENTRYPOINT ["pagekeeper-engine"]
CMD ["serve", "--help"]
ARG VERSION
ARG REVISION
ARG SOURCE
LABEL org.opencontainers.image.title="pagekeeper-engine" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"
