"""The run's nodes: which supervisor node runs each planned node, the ports the plan binds here, and
a lost node holding trainer ranks. May import tether.placement, tether.runtime, tether.records and
tether.train.checkpoint.layout (where the last complete checkpoint is)."""
