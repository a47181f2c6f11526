# The README's two commands: `make demo` (the heterogeneous training job) and
# `make test` (the test suite CI runs). Both first set up the project
# virtualenv (scripts/setup.sh: no root, no Docker) and run everything from it.
#
#   make test TORCH=2.4.1                 # the same against another torch (own venv)
#   make test PYTEST_ARGS="tests/unit -x"  # a part of the suite
#   make test EXTRAS=test                 # fewer extras in the venv
PYTHON ?= python3
DEFAULT_TORCH := 2.13.0
TORCH ?= $(DEFAULT_TORCH)
VENV ?= $(if $(filter $(DEFAULT_TORCH),$(TORCH)),.venv,.venv-torch$(TORCH))
EXTRAS ?= test integrations
PYTEST_ARGS ?= tests

export PYTHON
export KAITIAN_TORCH := $(TORCH)
export KAITIAN_VENV := $(VENV)
export KAITIAN_EXTRAS := $(EXTRAS)

.PHONY: setup demo test pytest docker-engine

setup:
	bash scripts/setup.sh

demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" PYTHON="$(CURDIR)/$(VENV)/bin/python" bash examples/run_demo.sh

# As root, make sure a Docker engine runs (the docker tests need one); as a
# user, the docker tests say how to get one when none answers.
test: setup
	@if [ "$$(id -u)" = 0 ]; then bash scripts/docker-engine.sh; fi
	@$(MAKE) --no-print-directory pytest

# The suite without the setup step, in two passes side by side where the
# machine allows (scripts/test.sh): the `serial` tests one after the other, the
# rest on $(JOBS) pytest workers (pytest-xdist, a file per worker).
JOBS ?= 2
PASSES ?= both
export PYTEST_ARGS JOBS PASSES
pytest:
	@bash scripts/test.sh

docker-engine:
	bash scripts/docker-engine.sh
