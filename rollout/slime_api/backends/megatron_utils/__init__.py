"""`slime.backends.megatron_utils`: the context-parallel helpers loss hooks import (`cp_utils`)."""
