# A CPU image that runs the HOST's Python environment, for machines that cannot
# reach a registry (CI, air-gapped hosts). It holds only a skeleton root file
# system; /usr, the host's Python prefixes (a virtualenv's or conda env's too)
# and the kaitian checkout are bind-mounted read-only at run time at their host
# paths (the org.kaitian.host-mounts label lists them, comma-separated
# HOST:CONTAINER[:ro]).
# Built by `kaitian images build cpu-host`, which assembles the rootfs/ context;
# it only works on the host that built it. Nothing is pulled (FROM scratch, no
# digest to pin), and it is a single stage: there is nothing to build.
FROM scratch
COPY rootfs/ /
ARG HOST_MOUNTS=
ARG PYTHON=python3
ARG PATH_DIRS=/usr/local/bin:/usr/bin:/bin
# The environment's activation (empty when the host runs a plain interpreter).
ARG VIRTUAL_ENV=
ARG CONDA_PREFIX=
ENV PATH=${PATH_DIRS} VIRTUAL_ENV=${VIRTUAL_ENV} CONDA_PREFIX=${CONDA_PREFIX}
LABEL org.kaitian.host-mounts=${HOST_MOUNTS} org.kaitian.python=${PYTHON} org.kaitian.vendor=cpu
# Not root unless kaitianrun is asked (--container-user root).
USER 65534:65534
CMD ["sleep", "infinity"]
