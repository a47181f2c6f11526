# kaitian for Cambricon MLU workers, on Cambricon's PyTorch image (torch, torch_mlu,
# CNToolkit and CNCL inside). The image comes from Cambricon's registry or
# developer portal; set BASE to the tag matching your driver:
#   kaitian images build mlu --base yellow.hub.cambricon.com/pytorch/pytorch:v24.10-torch2.4.0-ubuntu22.04-py310
# kaitianrun gives the container /dev/cambricon_ctl and the selected
# /dev/cambricon_dev*, /dev/cambricon_ipcm* nodes.
#
# The base is the one image here without a digest pin: Cambricon's registry
# needs an account, and no digest of this tag could be read from public sources
# when this file was written. Pin the image your account pulls
# (`docker buildx imagetools inspect <tag>`) in your release build:
#   kaitian images build mlu --base yellow.hub.cambricon.com/pytorch/pytorch:<tag>@sha256:<digest>
ARG BASE=yellow.hub.cambricon.com/pytorch/pytorch:v24.10-torch2.4.0-ubuntu22.04-py310

# --- build: compile kaitian._C against the image's own torch ---
FROM ${BASE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "setuptools>=64" wheel ninja
COPY . /src
RUN pip wheel --no-cache-dir --no-build-isolation --no-deps -w /wheels /src

# --- runtime: the same image without the build tools, plus a non-root user ---
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends util-linux procps \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels \
 && pip install --no-cache-dir psutil numpy tomli-w "docker>=7" \
 && python -c "import torch_mlu, kaitian, kaitian._C"
RUN useradd --uid 1000 --create-home --shell /bin/sh kaitian
USER kaitian
LABEL org.kaitian.python=python org.kaitian.vendor=mlu
CMD ["sleep", "infinity"]
