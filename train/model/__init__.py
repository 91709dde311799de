"""The models: Megatron configs from flags, HF config and weights via the bridge, specs, MTP, CPU support.
May import tether.runtime, tether.train.config, tether.train.parallel and tether.train.state."""
