# kaitian for NVIDIA GPU workers, on the PyTorch CUDA images (torch, CUDA, NCCL inside).
#   kaitian images build cuda           (context: the repository root)
#   docker build -f dockerfiles/cuda.Dockerfile -t kaitian:cuda .
# Run it with the NVIDIA container toolkit installed on the host; kaitianrun
# passes the selected GPUs as a device request (by UUID).
#
# Base image pins: release builds pin both stages by digest (with its '@'):
#   docker buildx imagetools inspect pytorch/pytorch:2.7.1-cuda12.6-cudnn9-devel
#   docker buildx imagetools inspect pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime
#   docker build --build-arg BUILD_DIGEST=@sha256:<devel> --build-arg BASE_DIGEST=@sha256:<runtime> ...
# No digest is recorded here: it must be read from the registry, which the
# machine that wrote this file could not reach (see docs/docker.md).
ARG BUILD_BASE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-devel
ARG BUILD_DIGEST=
ARG BASE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime
ARG BASE_DIGEST=

# --- build: compile kaitian._C against the image's own torch ---
FROM ${BUILD_BASE}${BUILD_DIGEST} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "setuptools>=64" wheel ninja
COPY . /src
# No build isolation and no deps: never pull another torch.
RUN pip wheel --no-cache-dir --no-build-isolation --no-deps -w /wheels /src

# --- runtime: the same torch without compilers, plus a non-root user ---
FROM ${BASE}${BASE_DIGEST}
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
