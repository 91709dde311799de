"""Processes of a run: supervisor, node agent, specs, zygote fork server, shim, signals, sd_notify.
May import tether.runtime.rpc, tether.runtime.files and the runtime's top-level modules."""
