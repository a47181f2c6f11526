# kaitian for NVIDIA GPU workers, on the PyTorch CUDA image (torch, CUDA, NCCL inside).
#   kaitian images build cuda           (context: the repository root)
#   docker build -f dockerfiles/cuda.Dockerfile -t kaitian:cuda .
# Run it with the NVIDIA container toolkit installed on the host; kaitianrun
# passes the selected GPUs as a device request.
ARG BASE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-devel
FROM ${BASE}

RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ util-linux procps \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "setuptools>=64" wheel ninja

COPY . /opt/kaitian-src
# Build against the image's own torch (no build isolation: never pull another torch).
RUN pip install --no-cache-dir --no-build-isolation --no-deps /opt/kaitian-src \
 && pip install --no-cache-dir psutil numpy tomli-w "docker>=7" \
 && rm -rf /opt/kaitian-src \
 && python -c "import kaitian, kaitian._C"

LABEL org.kaitian.python=python org.kaitian.vendor=cuda
CMD ["sleep", "infinity"]
