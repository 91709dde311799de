"""Model families that need more than Megatron's GPT spec and mbridge's bridges: each module holds one
family's bridge class and spec changes. May import tether.train.model's Megatron plumbing (megatron_cpu, spec)."""
