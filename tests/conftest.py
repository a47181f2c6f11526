"""Shared pytest set-up: ``tests/`` is on ``sys.path`` (``pythonpath`` in
pyproject.toml), so tests import their helpers as ``support.*``."""
