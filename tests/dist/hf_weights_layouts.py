"""Two gloo ranks: `model.hf_path` weights loaded straight into a TP=2, PP=2 and EP=2 trainer.

Run: python -m torch.distributed.run --nproc_per_node 2 --master_port P tests/dist/hf_weights_layouts.py HF OUT
HF is a tiny Qwen3-MoE directory (tests/hf_model_dir.py). For every layout a trainer (QAT off, fp32) is built,
`load_hf_weights` fills its shards from HF's safetensors, and its log-probs of fixed tokens are saved; rank 0
writes OUT/logp_<layout>.pt. tests/test_hf_model_job.py compares them with transformers' own forward.
"""
from __future__ import annotations

import sys
from pathlib import Path

LAYOUTS = {"tp2": {"tensor_parallel": 2}, "pp2": {"pipeline_parallel": 2}, "ep2": {"expert_parallel": 2}}


def main(hf_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_qrl.config import from_dict
    from megatron_qrl.convert.load_hf import load_hf_weights
    from megatron_qrl.platform import teardown
    from megatron_qrl.trainer import Trainer

    tokens = torch.load(Path(out) / "tokens.pt")
    for name, layout in LAYOUTS.items():
        cfg = from_dict({"model": {"hf_path": hf_dir}, "quant": {"format": "bf16", "qat": False},
                         "trace": {"enabled": False}, "trainer": {"micro_batch_size": 4, **layout}})
        trainer = Trainer(cfg)
        load_hf_weights(trainer, hf_dir)
        logp = trainer.logprobs({"tokens": tokens})
        if dist.get_rank() == 0:
            torch.save(logp, Path(out) / f"logp_{name}.pt")
    teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
