"""The docker runtime: each vendor group's workers in its own container."""
