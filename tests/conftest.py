"""Test-session setup. Without a GPU, Triton kernels can only run in its CPU interpreter, and the choice is
made when triton is first imported (megatron-core imports it at import time), so it is set here, before
any test module loads."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
