#!/usr/bin/env bash
# Runs a command at a low CPU priority: it takes the CPU the rest of the machine
# leaves idle, and a small share when the rest is busy:
# `bash scripts/background.sh CMD...` (exit status: CMD's).
# `bash scripts/background.sh --check` says (exit 0) whether that can be done.
#
# nice 19 alone is not enough: with the kernel's autogroups (on by default) each
# new session gets its own group of equal weight, and the tests start their
# ranks and agents in new sessions. So as root the command runs in its own CPU
# cgroup of a low weight (cgroup v1 `cpu.shares`, v2 `cpu.weight`), which
# everything it starts inherits, sessions included; it is removed again when the
# command ends (with whatever the command left running in it).
# The weight is a quarter of a default group's, not `cpu.idle`: an idle group
# gets almost nothing while the rest is busy, and CI saw a starved agent miss
# its peer's 60 s rendezvous timeout.
# Without root (or without a cpu controller) there is no such isolation: --check fails.
set -uo pipefail

cpu_root() {  # the cgroup directory whose children take a CPU weight, or nothing
  [ "$(id -u)" = 0 ] || return 1
  if [ -f /sys/fs/cgroup/cpu/cpu.shares ]; then
    echo /sys/fs/cgroup/cpu  # v1
  elif grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
    grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control || echo +cpu > /sys/fs/cgroup/cgroup.subtree_control || return 1
    echo /sys/fs/cgroup  # v2
  else
    return 1
  fi
}

low_weight() {  # low_weight GROUP: gives the group a quarter of a default group's weight
  if [ -f "$1/cpu.shares" ]; then echo 256 > "$1/cpu.shares"; else echo 25 > "$1/cpu.weight"; fi
}

root=$(cpu_root) || root=
if [ "${1:-}" = --check ]; then  # the real thing, once: a group made and removed
  [ -n "$root" ] && mkdir "$root/kaitian-background-check-$$" 2>/dev/null || exit 1
  low_weight "$root/kaitian-background-check-$$" 2>/dev/null
  rc=$?
  rmdir "$root/kaitian-background-check-$$"
  exit $rc
fi
[ $# -gt 0 ] || { echo "usage: bash scripts/background.sh CMD... | --check" >&2; exit 2; }

group=
if [ -n "$root" ]; then
  group=$root/kaitian-background-$$
  if mkdir "$group" 2>/dev/null && low_weight "$group" && echo $$ > "$group/cgroup.procs"; then
    :
  else
    rmdir "$group" 2>/dev/null
    group=
    echo "[background] no CPU cgroup of a low weight under $root: nice 19 only" >&2
  fi
fi
rc=0
nice -n 19 ionice -c 2 -n 7 "$@" &
child=$!
trap 'kill -TERM $child 2>/dev/null' TERM INT HUP  # (then clean up below)
while kill -0 $child 2>/dev/null; do wait $child; rc=$?; done
if [ -n "$group" ]; then
  echo $$ > "$root/cgroup.procs"
  # what is still in the group has outlived its command: an orphan
  for _ in 1 2 3 4 5; do
    rmdir "$group" 2>/dev/null && break
    xargs -r kill -KILL < "$group/cgroup.procs" 2>/dev/null
    sleep 0.2
  done
  [ ! -d "$group" ] || echo "[background] could not remove $group" >&2
fi
exit $rc
