"""megatron-qrl: FP4 RL post-training for MoE LLMs on Megatron-Core.

`kernels/` and `launch/` sit at the repository top level (the design card's layout) and install as
`megatron_qrl.kernels` and `megatron_qrl.launch`. From a plain checkout on PYTHONPATH (the GPU machines,
where nothing is pip-installed) the repository root joins this package's search path so the same names
resolve there too.
"""
import os as _os

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")) and _root not in __path__:
    __path__.append(_root)
