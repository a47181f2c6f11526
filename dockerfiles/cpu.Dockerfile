# kaitian for CPU workers (and simulated CPU vendor groups).
#   kaitian images build cpu            (context: the repository root)
#   docker build -f dockerfiles/cpu.Dockerfile -t kaitian:cpu .
#
# Base image pin: release builds pin the base by digest, passed as BASE_DIGEST
# (with its '@'):
#   docker buildx imagetools inspect python:3.11-slim-bookworm   # prints the digest
#   kaitian images build cpu --base python:3.11-slim-bookworm@sha256:<digest>
#   docker build --build-arg BASE_DIGEST=@sha256:<digest> -f dockerfiles/cpu.Dockerfile .
# No digest is recorded here: it must be read from the registry, which the
# machine that wrote this file could not reach (see docs/docker.md).
ARG BASE=python:3.11-slim-bookworm
ARG BASE_DIGEST=
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# --- build: compile kaitian._C into a wheel (compilers stay in this stage) ---
FROM ${BASE}${BASE_DIGEST} AS build
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
FROM ${BASE}${BASE_DIGEST}
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
