# The image every raypipe node runs: Ray 2.60 + torch 2.13 + this repository's code, installed
# from the build context (the checkout you build from), not from a package registry.
#
#   docker build -t raypipe:cpu .                                   # CPU (head nodes, CPU-only clusters)
#   docker build -t raypipe:cuda \
#     --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-cu128 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # GPU workers
#
# Used by deployments/kuberay/ (RayService, RayJob) and, optionally, by cluster.yaml's `docker:`
# section (which by default installs a wheel of this repository on stock Ray images instead).
# Models are not baked in: pass an s3:// model URI (copied once per node into a local cache) or a
# path that exists on every node (a shared volume); the `tiny`/`small` presets are built locally.

# Ray's own images: the launcher and KubeRay expect their user (ray), conda Python and tools.
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311-cpu
FROM ${BASE_IMAGE}

# torch is pinned exactly as the Makefile pins it, from an index that matches the base image:
# PyPI's default Linux torch is a multi-GB CUDA build, so CPU images take the CPU index.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The code of the checkout being built; `pip install .` brings Ray, transformers etc. (pyproject.toml).
WORKDIR /home/ray/raypipe
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users raypipe ./raypipe
COPY --chown=ray:users deployments ./deployments
RUN pip install --no-cache-dir . && python -c "import raypipe, raypipe.serve.app"

# Nodes have no internet in many clusters: never let transformers try the Hub at run time.
ENV HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
