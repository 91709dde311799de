"""`tether bench sync`: delta sizes and speeds, disk and delta sync, the distributed sync per
bucket against a raw broadcast, and the CUDA IPC sync on a GPU."""
