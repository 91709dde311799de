"""Weight buckets: grouping tensors into --update-weight-buffer-size buckets, filling them as the
export produces tensors, and pumping them onto the wire in one thread. May import tether.runtime."""
