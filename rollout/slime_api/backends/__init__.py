"""`slime.backends`: of slime's trainer backends, only what loss hooks import (`megatron_utils.cp_utils`)."""
