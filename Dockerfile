# vqserve GPU serving image (default) and a CPU variant (`--build-arg VARIANT=cpu`).
#
#   docker build -t vqserve:gpu .                            # CUDA 12.8, torch cu128, onnxruntime-gpu
#   docker build -t vqserve:cpu --build-arg VARIANT=cpu .    # nodes without a GPU
#   docker run --gpus all -p 50051:50051 -p 50052:50052 vqserve:gpu
#
# Every `vqserve serve` setting is also a VQSERVE_* environment variable (docs/DEPLOY.md).
# The install steps live in docker/install.sh, which `make test` also runs (CPU variant).

# gpu | cpu: which base the runtime image is built on
ARG VARIANT=gpu
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
# base, not runtime: torch's CUDA wheels bring their own CUDA libraries; the image only
# needs the driver, which the NVIDIA container toolkit mounts at run time
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

# ---- stage 1: build the vqserve wheel (pure Python; the default tokenizer is package data)
FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY vqserve ./vqserve
COPY core ./core
COPY training ./training
COPY model ./model
COPY export ./export
COPY serve ./serve
COPY offline ./offline
COPY bench ./bench
RUN pip install --no-cache-dir setuptools==75.8.0 wheel==0.45.1 \
 && pip wheel --no-cache-dir --no-deps --no-build-isolation -w /wheels .

# ---- GPU base: CUDA runtime from torch's wheels, onnxruntime-gpu ----------------------------
FROM ${CUDA_IMAGE} AS base-gpu
ENV DEBIAN_FRONTEND=noninteractive
# the base image is pinned by tag; pinning Ubuntu's point releases of python3 here would
# break the build at every security update, so the interpreter follows the pinned base
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY docker/install.sh constraints.txt /opt/vqserve-src/
COPY --from=wheels /wheels /opt/vqserve-src/wheels
RUN PIP_NO_CACHE_DIR=1 /opt/vqserve-src/install.sh gpu /opt/vqserve /opt/vqserve-src/wheels \
        /opt/vqserve-src/constraints.txt \
 && rm -rf /opt/vqserve-src
# Exact by default on GPU nodes too: fp32 with TF32 off. bf16 (about 3.6x faster on an H100,
# 99.67 % of tokens equal to fp32) is something a deployment asks for: VQSERVE_DTYPE=bf16.
# Request handling runs in front-end processes before one device executor (--frontends auto).
ENV VQSERVE_DEVICE=cuda \
    VQSERVE_DTYPE=fp32

# ---- CPU base ----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base-cpu
COPY docker/install.sh constraints.txt /opt/vqserve-src/
COPY --from=wheels /wheels /opt/vqserve-src/wheels
RUN PIP_NO_CACHE_DIR=1 TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
        /opt/vqserve-src/install.sh cpu /opt/vqserve /opt/vqserve-src/wheels \
        /opt/vqserve-src/constraints.txt \
 && rm -rf /opt/vqserve-src
ENV VQSERVE_DEVICE=cpu

# ---- the runtime image, either base (the default target: the last stage) -------------------
# base-gpu / base-cpu are stages of this file, not registry images: nothing to tag
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin vqserve
ENV PATH=/opt/vqserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    VQSERVE_MODEL=default \
    VQSERVE_HOST=0.0.0.0 \
    VQSERVE_PORT=50051 \
    VQSERVE_METRICS_PORT=50052
USER 10001
EXPOSE 50051 50052
# asks grpc.health.v1: NOT_SERVING while the model loads, while draining and while the model
# makes no progress (--stall-timeout); a poisoned CUDA context exits 70 instead
# start period: model load plus the first start's plan measurement (--plan auto, ~3 min on
# 2 CPU cores with its in-process ONNX export; cached in ~/.cache/vqserve/plans with the
# exports it measured, mount a volume there to keep it)
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["vqserve", "health", "--server", "localhost:50051", "--timeout", "4"]
STOPSIGNAL SIGTERM
# exec form: vqserve is PID 1 and gets SIGTERM itself, so `docker stop` drains in-flight calls
ENTRYPOINT ["vqserve", "serve"]
