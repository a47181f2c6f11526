# A CPU image that runs the HOST's Python environment, for machines that cannot
# reach a registry (CI, air-gapped hosts). It holds only a skeleton root file
# system; /usr, the host's Python prefix and the kaitian checkout are bind-mounted
# at run time at their host paths (the org.kaitian.host-mounts label lists them, comma-separated HOST:CONTAINER[:ro]).
# Built by `kaitian images build cpu-host`, which assembles the rootfs/ context;
# it only works on the host that built it.
FROM scratch
COPY rootfs/ /
ARG HOST_MOUNTS=
ARG PYTHON=python3
ARG PATH_DIRS=/usr/local/bin:/usr/bin:/bin
ENV PATH=${PATH_DIRS}
LABEL org.kaitian.host-mounts=${HOST_MOUNTS} org.kaitian.python=${PYTHON} org.kaitian.vendor=cpu
CMD ["sleep", "infinity"]
