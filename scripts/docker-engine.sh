#!/usr/bin/env bash
# Makes sure a Docker engine answers on this machine: installs Debian's docker.io
# if dockerd is missing and starts it in the background. Needs root. Safe to run
# again (an engine that already answers is left alone).
#
# This machine may itself be a container, so dockerd is tried with its defaults
# first (overlay2, iptables) and then with what works inside a container:
# the vfs storage driver, and no iptables / bridge. The first that answers wins.
set -euo pipefail

log() { printf '[docker] %s\n' "$*"; }
LOG=/var/log/kaitian-dockerd.log
PIDFILE=/var/run/docker.pid

if docker info >/dev/null 2>&1; then
  log "engine already running"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  log "no Docker engine answers and starting one needs root: run 'sudo bash $0'"
  exit 1
fi
if ! command -v dockerd >/dev/null 2>&1; then
  log "installing docker.io (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq docker.io >/dev/null
fi
if ! command -v docker >/dev/null 2>&1; then
  log "dockerd is installed but the docker CLI is not; install docker.io or docker-ce-cli"
  exit 1
fi

# A dockerd killed earlier leaves its pid file behind, and a new one refuses to start.
if [ -f "$PIDFILE" ] && ! kill -0 "$(cat "$PIDFILE" 2>/dev/null)" 2>/dev/null; then
  rm -f "$PIDFILE" /var/run/docker/containerd/containerd.pid
fi

try_start() {  # $@: extra dockerd flags; returns 0 once the engine answers
  log "starting dockerd $*"
  mkdir -p "$(dirname "$LOG")"
  nohup dockerd "$@" >>"$LOG" 2>&1 &
  local pid=$!
  for _ in $(seq 1 60); do
    if docker info >/dev/null 2>&1; then
      log "engine up ($(docker info --format '{{.ServerVersion}}, storage {{.Driver}}'))"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      log "dockerd $* exited; see $LOG"
      return 1
    fi
    sleep 1
  done
  log "dockerd $* did not answer in 60s; stopping it"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 15); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$PIDFILE"
  return 1
}

try_start && exit 0
try_start --storage-driver=vfs && exit 0
try_start --storage-driver=vfs --iptables=false --bridge=none && exit 0

log "dockerd did not come up; last lines of $LOG:"
tail -n 20 "$LOG" >&2
exit 1
