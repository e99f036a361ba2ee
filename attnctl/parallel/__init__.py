"""Parallelism: a model split over ranks (tensor, sequence, context, data parallel, ZeRO).

- ``plan``: one rank's plan and weights (torch-free)
- ``split``: the split estimate, every rank's memory and its training step (torch-free)
- ``distributed``: starting the ranks (gloo, NCCL) that measure a split
- ``rank``: what one rank runs, measures and sends back
"""
