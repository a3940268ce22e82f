"""LoRA on a packed NVFP4 base: TP=2 (+ sequence parallelism) against one process (tests/test_lora.py).

Run: python -m torch.distributed.run --nproc_per_node N tests/dist/lora_tp.py MODE OUT
  MODE=ref (N=1): build the LoRA trainer, save its initial checkpoint to OUT/init, record log-probs, the
                  losses of 2 optimizer steps and the log-probs after them (OUT/ref.pt);
  MODE=tp2 (N=2): the same config at tensor_parallel=2 loads OUT/init (resharding the packed base and the
                  adapters), repeats the same steps; rank 0 writes the differences to OUT/tp2.json.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mcore_common as common  # noqa: E402

common.add_repo_to_path()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(mode: str, out: Path) -> None:
    import json

    import torch

    from megatron_qrl.config import load_config
    from megatron_qrl.models import sequence_parallel_enabled
    from megatron_qrl.trainer import Trainer
    from test_lora import LORA, TINY, loss_fn, make_batch

    tp = 2 if mode == "tp2" else 1
    cfg = load_config(None, TINY + LORA + [f"trainer.tensor_parallel={tp}", "trainer.lr=1e-2"])
    trainer = Trainer(cfg)
    if mode == "ref":
        trainer.save(str(out / "init"), {})
    else:
        trainer.load(str(out / "init"), load_optimizer=False)
    batch = make_batch()
    logp0 = trainer.logprobs(batch)
    losses = [trainer.train_step(batch, loss_fn)["loss"] for _ in range(2)]
    logp1 = trainer.logprobs(batch)
    if mode == "ref":
        torch.save({"logp0": logp0, "losses": losses, "logp1": logp1}, out / "ref.pt")
        return
    ref = torch.load(out / "ref.pt")
    res = {"tp": tp, "sequence_parallel": sequence_parallel_enabled(cfg),
           "logp_init": float((logp0 - ref["logp0"]).abs().max()),
           "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
           "logp_after": float((logp1 - ref["logp1"]).abs().max()),
           "adapters_moved": float((ref["logp1"] - ref["logp0"]).abs().max())}
    if common.rank() == 0:
        common.write_json(out / "tp2.json", res)
        print(json.dumps(res))


if __name__ == "__main__":
    common.setup_threads()
    main(sys.argv[1], Path(sys.argv[2]))
