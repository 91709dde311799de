"""The CPU engine's weight updates: buckets broadcast by the trainer, streamed from disk, and the weight checker.
May import the model."""
