#!/usr/bin/env bash
# `make pytest` (and `make test` after the setup): the suite in its two passes
# (tests/conftest.py). The `serial` tests need the machine: they run one after
# the other in the foreground. The rest runs on $JOBS pytest workers (xdist, a
# file per worker) beside them, in the background (scripts/background.sh: the
# CPU the serial pass leaves idle, and a small share while it is busy) where
# that can be done, else after them.
# Its output follows the serial pass's.
#
# Environment (the Makefile sets it): KAITIAN_VENV, PYTEST_ARGS (shell words),
# JOBS, PASSES (both, serial or parallel: CI runs each pass in its own lane).
# A pass that selects nothing is fine; both selecting nothing is an error (exit 5).
set -uo pipefail
case $KAITIAN_VENV in /*) venv=$KAITIAN_VENV ;; *) venv=$PWD/$KAITIAN_VENV ;; esac
export PATH="$venv/bin:$PATH"
py=$venv/bin/python
eval "set -- ${PYTEST_ARGS:-tests}"
# A worker that crashes fails the test it ran, named, and is not replaced: a replacement under
# --dist loadfile can wait forever for work (pytest-xdist #1327: CI once sat idle 15 minutes, until stopped).
parallel=("$py" -m pytest -n "${JOBS:-2}" --dist loadfile --max-worker-restart 0 -m "not serial" "$@")
serial=("$py" -m pytest -m serial "$@")

# none_here EXIT PASS: pytest's "N deselected / 0 selected" for a pass with none of its kind
# among the tests asked for reads as a fault; it is not
none_here() {
  [ "$1" = 5 ] || return 0
  case $2 in
    serial) echo "[test] the serial pass had nothing to run: no test here is marked serial (not an error)" ;;
    parallel) echo "[test] the parallel pass had nothing to run: every test here is marked serial (not an error)" ;;
  esac
}
run_serial() { "${serial[@]}"; srl=$?; none_here $srl serial; }
run_parallel() { "${parallel[@]}"; par=$?; none_here $par parallel; }

par=5 srl=5
case ${PASSES:-both} in
  parallel) run_parallel ;;
  serial) run_serial ;;
  both)
    if bash scripts/background.sh --check; then
      log=$(mktemp)
      trap 'rm -f "$log"' EXIT
      bash scripts/background.sh "${parallel[@]}" > "$log" 2>&1 &
      pid=$!
      echo "[test] the parallel pass runs in the background (pid $pid); its output follows the serial pass's"
      run_serial
      wait $pid; par=$?
      printf '\n[test] the parallel pass (exit %s):\n' "$par"
      cat "$log"
      none_here $par parallel
    else
      run_parallel
      run_serial
    fi ;;
  *) echo "scripts/test.sh: PASSES must be both, serial or parallel, not '$PASSES'" >&2; exit 2 ;;
esac
if [ $par = 5 ] && [ $srl = 5 ]; then
  echo "make test: pytest collected no tests from '${PYTEST_ARGS:-tests}' (exit 5)"
  exit 5
fi
[ $par = 5 ] && par=0
[ $srl = 5 ] && srl=0
[ $par = 0 ] || exit $par
exit $srl
