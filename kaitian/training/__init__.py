"""Heterogeneity-aware data parallelism.

split (the split algorithm, capabilities, the re-balancer's balanced split), sampler
(epoch layout, stepping, checkpoints), weighting (``scale_loss``, the step
check), ddp (kaitian's DDP on the same weighting), rebalance, clock
(device-event step timing), exchange (the one slot-sum exchange), listeners,
capability (``kaitian init``).
"""
