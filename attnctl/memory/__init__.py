"""Memory: the estimate a plan sums to, the measurement of a run, and the machine.

- ``estimate``: parameters, activations with liveness, peaks, KV cache (torch-free)
- ``measure``: the bytes a run really allocates, stage by stage
- ``resources``: free memory, pre-flights, time estimates
"""
