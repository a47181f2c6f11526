# kaitian for Cambricon MLU workers, on Cambricon's PyTorch image (torch, torch_mlu,
# CNToolkit and CNCL inside). The image comes from Cambricon's registry or
# developer portal; set BASE to the tag matching your driver:
#   kaitian images build mlu --base yellow.hub.cambricon.com/pytorch/pytorch:v24.10-torch2.4.0-ubuntu22.04-py310
# kaitianrun gives the container /dev/cambricon_ctl and the selected
# /dev/cambricon_dev*, /dev/cambricon_ipcm* nodes.
ARG BASE=yellow.hub.cambricon.com/pytorch/pytorch:v24.10-torch2.4.0-ubuntu22.04-py310
FROM ${BASE}

RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ util-linux procps \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "setuptools>=64" wheel ninja

COPY . /opt/kaitian-src
RUN pip install --no-cache-dir --no-build-isolation --no-deps /opt/kaitian-src \
 && pip install --no-cache-dir psutil numpy tomli-w "docker>=7" \
 && rm -rf /opt/kaitian-src \
 && python -c "import torch_mlu, kaitian, kaitian._C"

LABEL org.kaitian.python=python org.kaitian.vendor=mlu
CMD ["sleep", "infinity"]
