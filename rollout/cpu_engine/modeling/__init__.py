"""The CPU engine's decoder in plain torch: the model, its attention variants (MLA), MoE, RoPE, and `tether init-model`'s tiny models.
May import torch and safetensors; nothing of the engine's HTTP side."""
