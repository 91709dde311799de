"""Model families the engine groups by the decoder they share (its own table: the engine is a server
reached over HTTP and imports nothing from the trainer, whose `hf_config` keeps the same groups)."""

from __future__ import annotations

# DeepSeek-V3's decoder under three names: GLM-4.7-Flash and Kimi-K2 carry DeepSeek-V3's layers.
MLA_MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite", "kimi_k2")
# Routed as DeepSeek-V3 routes: sigmoid scores, a selection bias, groups, scaled weights.
DEEPSEEK_ROUTER_MODEL_TYPES = ("glm4_moe", *MLA_MODEL_TYPES)
