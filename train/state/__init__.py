"""The trainer's state: offload, weight copies, optimizer reset, frozen params, ref and old actor.
May import tether.runtime, tether.train.config, tether.train.model and tether.train.parallel."""
