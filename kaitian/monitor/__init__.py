"""``kaitianrun --monitor``: what the workers record and what the agent makes of it.

- :mod:`.records`: the per-rank JSON-lines step records (written by the
  workers' DDP and Rebalancer, read by the agent) — the one definition of the
  format.
- :mod:`.agent`: the agent side: utilisation sampling while the job runs, and
  the report (``monitor.png``, ``summary.txt``) at the end.
"""
