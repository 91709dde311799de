"""A run's records: its directory (receipt, logs, checkpoints), metrics, progress, checkpoint retention.
May import tether.config and the components; never tether.run, tether.checks or tether.commands."""
