"""The model description, torch-free: what a layer or a checkpoint is.

- ``config``: the seeded layer's options and presets
- ``describe``: the model description the planner, the torch code and the replay walk
- ``checkpoint``: reading a checkpoint folder's config.json and safetensors headers
- ``families``: one module a family, turning its config.json into a description
- ``rope``: rotary positions (every scaling type)
- ``layout``: how a model's heads, vocabulary and sequence are divided over ranks
"""
