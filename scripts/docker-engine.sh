#!/usr/bin/env bash
# Makes sure a Docker engine answers on this machine: installs Debian's docker.io
# if dockerd is missing and starts it in the background. Needs root.
set -euo pipefail

log() { printf '[docker] %s\n' "$*"; }

if docker info >/dev/null 2>&1; then
  log "engine already running"
  exit 0
fi
if ! command -v dockerd >/dev/null 2>&1; then
  log "installing docker.io"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq docker.io >/dev/null
fi
log "starting dockerd"
mkdir -p /var/log
nohup dockerd >/var/log/kaitian-dockerd.log 2>&1 &
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then
    log "engine up"
    exit 0
  fi
  sleep 1
done
log "dockerd did not come up; last lines of /var/log/kaitian-dockerd.log:"
tail -n 20 /var/log/kaitian-dockerd.log >&2
exit 1
