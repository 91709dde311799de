"""RPC between processes: the ZeroMQ actors, wire format, sockets, endpoints, secrets, liveness.
May import the runtime's top-level modules and tether.runtime.files, nothing else of tether."""
