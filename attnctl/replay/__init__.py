"""The training replay, torch-free: a training step's forward, backward and optimizer
step as the allocations torch makes, in order. The third twin of ``stages/`` (the plan)
and ``nn/`` (the torch code), under the same stage names.

- ``step``: the walk over a plan's stages and the phase peaks (``replay_step``)
- ``stages``, ``attention``, ``collectives``, ``ring``: each stage's saved tensors and
  backward, one module a kind of stage
- ``autograd``: the replay's bookkeeping (what is alive, when it is freed)
"""
