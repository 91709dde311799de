"""tether: RL post-training on Megatron-core and SGLang, without Ray."""
