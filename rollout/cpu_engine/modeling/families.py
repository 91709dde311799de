"""Model families the engine groups by the decoder they share (its own table: the engine is a server
reached over HTTP and imports nothing from the trainer, whose `hf_config` keeps the same groups)."""

from __future__ import annotations

# DeepSeek sparse attention (DSA, dsa.py): DeepSeek-V3's decoder with an indexer that picks the keys
# each query attends to (GLM-5, DeepSeek-V3.2).
DSA_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
# DeepSeek-V3's decoder under its names: GLM-4.7-Flash and Kimi-K2 carry DeepSeek-V3's layers, the
# sparse-attention families add their indexer to them.
MLA_MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite", "kimi_k2", *DSA_MODEL_TYPES)
# Routed as DeepSeek-V3 routes: sigmoid scores, a selection bias, groups, scaled weights.
DEEPSEEK_ROUTER_MODEL_TYPES = ("glm4_moe", *MLA_MODEL_TYPES)
