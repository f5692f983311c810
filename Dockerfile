# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target operator -t pagekeeper-operator .   (slim Python, no torch)
#   docker build --target engine   -t pagekeeper-engine .     (CUDA PyTorch base)
# Build arguments:
#   PYTHON_IMAGE  base of the operator image (default python:3.12-slim-bookworm)
#   TORCH_IMAGE   base of the engine image; must ship CUDA PyTorch >= 2.4 with Python >= 3.11
#   UID           numeric user both images run as (default 10001)
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG TORCH_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

# ---- operator -------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator
ARG UID=10001
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
# Only the operator package is copied, so only it is installed. The project itself is the
# package being installed here, not a registry package to pin (DL3013).
# hadolint ignore=DL3013
RUN pip install ".[operator]" && rm -rf /src \
 && useradd --uid "${UID}" --no-create-home --shell /usr/sbin/nologin pagekeeper
WORKDIR /
USER ${UID}
# Settings come from PAGEKEEPER_* environment variables (docs/operator.md).
ENTRYPOINT ["kopf", "run", "--module", "pagekeeper_operator.main"]
CMD ["--all-namespaces"]

# ---- engine ---------------------------------------------------------------------------------
FROM ${TORCH_IMAGE} AS engine
ARG UID=10001
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp TRITON_CACHE_DIR=/tmp/triton
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine/ engine/
# torch comes from the base image; pip keeps it because it already satisfies the requirement.
# hadolint ignore=DL3013
RUN pip install ".[engine]" && rm -rf /src \
 && useradd --uid "${UID}" --no-create-home --shell /usr/sbin/nologin pagekeeper
WORKDIR /
USER ${UID}
EXPOSE 8000
ENTRYPOINT ["pagekeeper-engine"]
CMD ["serve", "--help"]
