"""Heterogeneity-aware data parallelism: split, sampler, DDP weighting, re-balancing."""
