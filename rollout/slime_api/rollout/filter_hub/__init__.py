"""`slime.rollout.filter_hub`: dynamic-sampling filters (`dynamic_sampling_filters`) and their types."""
