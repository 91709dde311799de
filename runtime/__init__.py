"""The runtime every process shares: errors, the uvloop entry, configuration helpers, weight
groups and bucket streams at the top; rpc/ (ZeroMQ actors), process/ (supervisor, agent, zygote),
files/ (atomic writes, safe paths). Imports nothing else of tether."""
