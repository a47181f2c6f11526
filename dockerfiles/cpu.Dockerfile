# kaitian for CPU workers (and simulated CPU vendor groups).
#   kaitian images build cpu            (context: the repository root)
#   docker build -f dockerfiles/cpu.Dockerfile -t kaitian:cpu .
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# util-linux gives taskset/setsid (worker pinning and process groups); g++ builds kaitian._C.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ util-linux procps \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
 && pip install --no-cache-dir "setuptools>=64" wheel ninja

COPY . /opt/kaitian-src
RUN pip install --no-cache-dir --no-build-isolation /opt/kaitian-src \
 && rm -rf /opt/kaitian-src \
 && python -c "import kaitian, kaitian._C"

LABEL org.kaitian.python=python3 org.kaitian.vendor=cpu
CMD ["sleep", "infinity"]
