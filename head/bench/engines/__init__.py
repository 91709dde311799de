"""`tether bench engine` and `tether bench rollout`: CPU engine throughput and the rollout loops
on long-tail engines, with the helpers that start CPU engines (also a slowed one) for them."""
