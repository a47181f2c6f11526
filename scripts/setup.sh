#!/usr/bin/env bash
# Sets up the project virtualenv that `make demo` and `make test` run from:
# torch (exactly the version asked for), the build tools, and kaitian itself
# (editable, its C++ extension built against that torch) with the extras named.
# Needs neither root nor Docker. Safe to run again: what is already right is kept.
#
#   scripts/setup.sh                  # .venv with torch 2.13.0 and the [test,integrations] extras
#   KAITIAN_TORCH=2.4.1 KAITIAN_VENV=.venv-torch2.4.1 scripts/setup.sh
#   KAITIAN_EXTRAS=test scripts/setup.sh     # only the [test] extra
#
# Every pip call here runs under a constraint file pinning torch to the version
# asked for, so no dependency (and no extra) can swap in another torch - on
# PyPI, any torch other than the one asked for would be a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH=${KAITIAN_TORCH:-2.13.0}
VENV=${KAITIAN_VENV:-.venv}
EXTRAS=${KAITIAN_EXTRAS:-test integrations}

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

case "$TORCH" in
  [0-9]*.[0-9]*.[0-9]*) ;;
  *) die "KAITIAN_TORCH=$TORCH: give an exact release such as 2.13.0 (supported: 2.4 to 2.15)" ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  log "creating the virtualenv $VENV ($("$PYTHON" --version 2>&1))"
  "$PYTHON" -m venv "$VENV" ||
    die "'$PYTHON -m venv' failed; install your Python's venv module (Debian/Ubuntu: apt-get install python3-venv) or set PYTHON=/path/to/python3"
fi
VPY="$VENV/bin/python"
VENV_ABS=$(cd "$VENV" && pwd)

export PIP_CONSTRAINT="$VENV_ABS/kaitian-constraints.txt"
echo "torch==$TORCH" > "$PIP_CONSTRAINT"
pip() { "$VPY" -m pip --disable-pip-version-check "$@"; }

torch_version() { "$VPY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true; }
if [ "$(torch_version)" != "$TORCH" ]; then
  log "installing torch $TORCH into $VENV"
  pip install -q "torch==$TORCH" numpy
fi
log "torch: $("$VPY" -c 'import torch; print(torch.__version__, "(CUDA " + torch.version.cuda + " build)" if torch.version.cuda else "(CPU build)")')"
if [ -n "${KAITIAN_TORCH_ONLY:-}" ]; then exit 0; fi  # CI fetches the other torches early

log "installing the build tools"
pip install -q "setuptools>=64" wheel ninja

# kaitian itself, editable: metadata, entry points and the extras' packages.
# Redone only when pyproject.toml or the extras change.
spec=.
[ -n "$EXTRAS" ] && spec=".[$(echo "$EXTRAS" | tr ' ' ',')]"
INSTALLED="$VENV_ABS/kaitian-installed"
want_install="$spec $(sha1sum pyproject.toml | cut -c1-40) $PWD"  # (an editable install points here)
if [ "$(cat "$INSTALLED" 2>/dev/null)" != "$want_install" ]; then
  log "installing kaitian$([ -n "$EXTRAS" ] && echo " with [$EXTRAS]") (editable)"
  KAITIAN_NO_EXTENSION=1 pip install -q --no-build-isolation -e "$spec"
  echo "$want_install" > "$INSTALLED"
fi

# The C++ extension, built in place against this venv's torch; its objects stay
# in build/<venv> so that a second run compiles only what changed. kaitian/_C
# serves one venv at a time: another venv's copy is relinked for this one.
STAMP=kaitian/.C-built-for
WANT="torch $TORCH in $VENV_ABS"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  rm -f kaitian/_C*.so
fi
BUILD_LOG="$VENV_ABS/kaitian-build.log"
log "building kaitian's C++ extension against torch $TORCH (log: $BUILD_LOG)"
if ! "$VPY" setup.py build_ext --inplace --build-temp "build/$(basename "$VENV_ABS")" > "$BUILD_LOG" 2>&1; then
  tail -n 40 "$BUILD_LOG" >&2
  die "the C++ extension did not build (the end of $BUILD_LOG is above)"
fi
echo "$WANT" > "$STAMP"
"$VPY" -c 'import kaitian._C' || die "kaitian._C does not import in $VENV (see the build output above)"
log "ready: $VENV (run things with $VENV/bin/python, or: source $VENV/bin/activate)"
