"""Platform support: the CPU/gloo runtime shim for Megatron-Core and process-group setup."""
from .distributed import (Layout, device, engine_world, init_distributed, job_placement, set_layout, seed_everything,
                          teardown, trainer_group)
from .placement import Placement

__all__ = ["Layout", "Placement", "device", "engine_world", "init_distributed", "job_placement", "set_layout", "seed_everything",
           "teardown", "trainer_group"]
