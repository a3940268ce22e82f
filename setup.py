"""megatron-qrl: FP4 RL post-training for MoE LLMs on Megatron-Core.

`kernels/` and `launch/` live at the repository top level (the design card's layout) but install as
`megatron_qrl.kernels` and `megatron_qrl.launch`, so `torchrun -m megatron_qrl.launch.train` works.
"""
from setuptools import find_packages, setup

# megatron-core 0.19.2 ships a cp311 wheel but declares Requires-Python >= 3.12; on Python 3.11 the
# setup scripts install it with --no-deps --ignore-requires-python (docs/INSTALL.md explains).
MEGATRON = "megatron-core==0.19.2"

setup(
    name="megatron-qrl",
    version="0.1.0",
    description="FP4 (NVFP4/MXFP4) RL post-training for MoE LLMs: Megatron-Core QAT, TRACE, AIS, AQN, R3",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_qrl", "megatron_qrl.*"])
    + ["megatron_qrl.kernels", "megatron_qrl.launch"],
    package_dir={"megatron_qrl.kernels": "kernels", "megatron_qrl.launch": "launch"},
    install_requires=[
        "torch>=2.6",
        "numpy<2.5",
        "packaging>=24.2",
        "pyyaml>=6",
        "pydantic>=2.6",
        "tqdm>=4.66",
        "rich>=13",
        "safetensors>=0.4",
        "einops>=0.7",
        # megatron-core 0.19 imports triton at import time (moe/ops/paged_stash.py), on CPU too
        "triton>=3.6",
        # model.hf_path: the model directory's tokenizer (AutoTokenizer) and chat template
        "transformers>=4.51",
        # data.task=math / data.reward=math_verify: symbolic answer checking (rl/rewards/math_verify_reward.py)
        "math-verify>=0.9.0",
        f"{MEGATRON}; python_version>='3.12'",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2", "triton>=3.6", "nvidia-modelopt==0.47.0",
                 "requests", "huggingface_hub", "transformers>=4.51", "wandb>=0.18", "matplotlib>=3.8",
                 "mpi4py", "mpich"],
        "monitor": ["wandb>=0.18", "matplotlib>=3.8"],
        "convert": ["nvidia-modelopt==0.47.0", "transformers>=4.51", "requests", "huggingface_hub"],
        # NVIDIA Apex is built from its own source (the PyPI "apex" is unrelated); never listed here.
        "gpu": ["triton>=3.6", "transformer_engine[pytorch]"],
        "sglang": ["sglang==0.5.15.post1"],
    },
    entry_points={"console_scripts": ["qrl=megatron_qrl.cli:main"]},
)
