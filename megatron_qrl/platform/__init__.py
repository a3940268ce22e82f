"""Platform support: the CPU/gloo runtime shim for Megatron-Core and process-group setup."""
from .distributed import Layout, device, init_distributed, set_layout, seed_everything, teardown

__all__ = ["Layout", "device", "init_distributed", "set_layout", "seed_everything", "teardown"]
