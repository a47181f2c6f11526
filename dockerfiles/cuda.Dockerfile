# kaitian for NVIDIA GPU workers, on the PyTorch CUDA images (torch, CUDA, NCCL inside).
#   kaitian images build cuda           (context: the repository root)
#   docker build -f dockerfiles/cuda.Dockerfile -t kaitian:cuda .
# Run it with the NVIDIA container toolkit installed on the host; kaitianrun
# passes the selected GPUs as a device request (by UUID).
#
# Both stages are pinned by digest: the torch 2.8.0 / CUDA 12.8 / cuDNN 9 pair on
# Docker Hub, digests as published for these tags (read from public pins: this
# file was written on a machine without registry access). To move to another
# pair, pin both stages again (`docker buildx imagetools inspect <tag>`); the
# build stage must carry the runtime stage's torch, which the last step proves
# by importing kaitian._C:
#   docker build --build-arg BUILD_BASE=pytorch/pytorch:<tag>-devel@sha256:<digest> \
#     --build-arg BASE=pytorch/pytorch:<tag>-runtime@sha256:<digest> -f dockerfiles/cuda.Dockerfile .
ARG BUILD_BASE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-devel@sha256:a7103283ea7113e10ae5d014bd2342acebda0bc53164b2f7b1dd6eb7a766bdb6
ARG BASE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime@sha256:417bd75df6365104c283ea4c1651fb3530d9eb5a4c2fafa51943cff2a94e6385

# --- build: compile kaitian._C against the image's own torch ---
FROM ${BUILD_BASE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "setuptools>=64" wheel ninja
COPY . /src
# No build isolation and no deps: never pull another torch.
RUN pip wheel --no-cache-dir --no-build-isolation --no-deps -w /wheels /src

# --- runtime: the same torch without compilers, plus a non-root user ---
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends util-linux procps \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels \
 && pip install --no-cache-dir psutil numpy tomli-w "docker>=7" \
 && python -c "import kaitian, kaitian._C"
RUN useradd --uid 1000 --create-home --shell /bin/sh kaitian
USER kaitian
LABEL org.kaitian.python=python org.kaitian.vendor=cuda
CMD ["sleep", "infinity"]
