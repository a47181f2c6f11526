# kaitian for CPU workers (and simulated CPU vendor groups).
#   kaitian images build cpu            (context: the repository root)
#   docker build -f dockerfiles/cpu.Dockerfile -t kaitian:cpu .
#
# The base is pinned by digest (python:3.11-slim-bookworm as published on Docker
# Hub; read from public pins: this file was written on a machine without
# registry access). A moving tag gets security updates, a digest does not:
# refresh the pin with `docker buildx imagetools inspect python:3.11-slim-bookworm`,
# or build on another base with
#   kaitian images build cpu --base python:3.12-slim-bookworm@sha256:<digest>
ARG BASE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# --- build: compile kaitian._C into a wheel (compilers stay in this stage) ---
FROM ${BASE} AS build
ARG TORCH_VERSION
ARG TORCH_INDEX
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
 && pip install --no-cache-dir "setuptools>=64" wheel ninja
COPY . /src
RUN pip wheel --no-cache-dir --no-build-isolation --no-deps -w /wheels /src

# --- runtime: torch, the wheel, and a non-root user ---
FROM ${BASE}
ARG TORCH_VERSION
ARG TORCH_INDEX
# util-linux gives taskset/setsid (worker pinning and process groups).
RUN apt-get update \
 && apt-get install -y --no-install-recommends util-linux procps \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
 && python -c "import kaitian, kaitian._C"
# kaitianrun runs workers as a non-root user it chooses (--container-user);
# this is the user for anything else started from the image.
RUN useradd --uid 1000 --create-home --shell /bin/sh kaitian
USER kaitian
LABEL org.kaitian.python=python3 org.kaitian.vendor=cpu
CMD ["sleep", "infinity"]
