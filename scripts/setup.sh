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

# "VERSION CUDA-or-- FILE" of the venv's torch (empty without one): one import, also the build stamp's
torch_id() { "$VPY" -c 'import torch; print(torch.__version__, torch.version.cuda or "-", torch.__file__)' 2>/dev/null || true; }
TORCH_ID=$(torch_id)
read -r torch_full torch_cuda _ <<< "$TORCH_ID"
if [ "${torch_full%%+*}" != "$TORCH" ]; then
  log "installing torch $TORCH into $VENV (a download of about 200 MB for the CPU build, several GB with CUDA)"
  pip install -q "torch==$TORCH" numpy
  TORCH_ID=$(torch_id)
  [ -n "$TORCH_ID" ] || die "torch $TORCH was installed into $VENV but does not import"
  read -r torch_full torch_cuda _ <<< "$TORCH_ID"
fi
log "torch: $torch_full ($([ "$torch_cuda" = - ] && echo "CPU build" || echo "CUDA $torch_cuda build"))"
if [ -n "${KAITIAN_TORCH_ONLY:-}" ]; then exit 0; fi  # CI fetches the other torches early

if ! "$VPY" -c 'import sys, ninja, wheel, setuptools; sys.exit(int(setuptools.__version__.split(".")[0]) < 64)' 2>/dev/null; then
  log "installing the build tools"
  pip install -q "setuptools>=64" wheel ninja
fi

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
# The stamp records what the build read (sources, setup.py, torch, Python,
# compiler and flags) and the files it made: while they match, nothing is
# built or linked (setup.py would relink both extensions every time).
STAMP=kaitian/.C-built-for
WANT="torch $TORCH in $VENV_ABS"
build_inputs() {
  { find cpp setup.py -type f | LC_ALL=C sort | xargs sha1sum
    "$VPY" --version
    echo "$TORCH_ID"
    "${CXX:-c++}" --version 2>&1 | head -n 1 || true
    env | grep -E '^(KAITIAN_BUILD_OPT|CC|CXX|CFLAGS|CXXFLAGS|CPPFLAGS|LDFLAGS)=' | LC_ALL=C sort || true
  } | sha1sum | cut -c1-40
}
built_files() { stat -c '%n %s %Y' kaitian/_C*.so kaitian/testing/_fake_accelerator*.so 2>/dev/null || true; }
INPUTS="inputs $(build_inputs)"
BUILD_LOG="$VENV_ABS/kaitian-build.log"
BUILD_TEMP="build/$(basename "$VENV_ABS")"

# ninja's "[3/9] c++ ... -c cpp/x.cpp -o ..." lines and the links, one short line each;
# everything to the log.
build_progress() {
  local line ext=extension start=$SECONDS
  while IFS= read -r line; do
    printf '%s\n' "$line" >> "$BUILD_LOG"
    if [[ $line =~ ^building\ \'([^\']+)\' ]]; then
      ext=${BASH_REMATCH[1]}
    elif [[ $line =~ ^\[([0-9]+/[0-9]+)\].*\ -c\ ([^ ]+)\ -o\  ]]; then
      log "  $ext: ${BASH_REMATCH[1]} compiled ${BASH_REMATCH[2]#"$PWD"/} ($((SECONDS - start)) s)"
    elif [[ $line == *" -shared "* ]]; then
      log "  $ext: linked ($((SECONDS - start)) s)"
    fi
  done
}

if [ "$(cat "$STAMP" 2>/dev/null)" = "$(printf '%s\n%s\n%s' "$WANT" "$INPUTS" "$(built_files)")" ]; then
  log "kaitian's C++ extension is up to date (sources, torch, compiler and flags unchanged): nothing to build"
else
  if [ "$(head -n 1 "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    rm -f kaitian/_C*.so
  fi
  if [ -d "$BUILD_TEMP" ]; then
    log "building kaitian's C++ extension against torch $TORCH: what changed (log: $BUILD_LOG)"
  else
    log "building kaitian's C++ extension against torch $TORCH: the first build compiles about a dozen" \
      "files, about 1 min on 2 cores (log: $BUILD_LOG)"
  fi
  : > "$BUILD_LOG"
  if ! "$VPY" setup.py build_ext --inplace --build-temp "$BUILD_TEMP" 2>&1 | build_progress; then
    tail -n 40 "$BUILD_LOG" >&2
    die "the C++ extension did not build (the end of $BUILD_LOG is above)"
  fi
  "$VPY" -c 'import kaitian._C' || die "kaitian._C does not import in $VENV (see the build output above)"
  printf '%s\n%s\n%s\n' "$WANT" "$INPUTS" "$(built_files)" > "$STAMP"
fi
log "ready: $VENV (run things with $VENV/bin/python, or: source $VENV/bin/activate)"
