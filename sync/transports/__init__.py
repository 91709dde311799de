"""The four ways weights reach the engines, one module each: full disk, delta disk, distributed
(NCCL / gloo broadcast) and colocated tensors (CUDA IPC). `tether.sync.factory` picks one from
the flags. May import tether.runtime, the rollout contract, engine_api and the rest of tether.sync."""
