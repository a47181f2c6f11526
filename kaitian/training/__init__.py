"""Heterogeneity-aware data parallelism.

sampler (split, epoch layout, checkpoints), weighting (``scale_loss``), ddp
(kaitian's DDP on the same weighting), rebalance, clock (device-event step
timing), exchange (the one slot-sum exchange), listeners, capability
(``kaitian init``), steps (the monitor's per-step records).
"""
