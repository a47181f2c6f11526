# The README's two commands: `make demo` (the heterogeneous training job) and
# `make test` (everything CI runs). Both set the machine up first.
PYTHON ?= python3

.PHONY: setup demo test

setup:
	bash scripts/setup.sh

demo: setup
	bash examples/run_demo.sh

test: setup
	$(PYTHON) -m pytest tests
