"""`slime.rollout` on tether: sglang_rollout, base_types, data_source, rm_hub, filter_hub."""
