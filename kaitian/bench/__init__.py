"""``kaitian bench …``: commands that print numbers, kaitian beside its baseline in one run.

Convention: a benchmark's per-rank worker is the benchmark's own module run with
``--worker`` under torchrun's environment (started by kaitianrun, torchrun, or
the module's local rank spawner), so a bench is one file.
"""
