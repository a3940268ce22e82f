"""2-rank gloo check: RL statistics on a data-parallel split equal the single-process result.

Run: python -m torch.distributed.run --nproc_per_node 2 --master_port P tests/dist/rl_ais_dp.py OUT
Each rank takes an uneven, group-splitting slice of one deterministic batch (rows [0, 7) and [7, 12) with
group_size 4), computes advantages, IS weights for every method and the globally normalised policy loss and
its gradient, and saves them to OUT.rank<r>; tests/test_rl_distributed.py compares with one process.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

GROUP_SIZE = 4
SPLIT = 7
CFG = {"C": 2.0, "delta": 0.05, "gamma": 1.0, "beta": 0.5, "tis_C": 2.0, "mis_U": 1.3, "mis_level": "token",
       "icepop_low": 0.8, "icepop_high": 1.25}
METHOD_CFGS = [("none", CFG), ("tis", CFG), ("mis", CFG), ("mis", {**CFG, "mis_level": "sequence"}),
               ("icepop", CFG), ("ais", CFG)]


def make_batch(batch: int = 12, seq: int = 6) -> dict[str, torch.Tensor]:
    """Deterministic batch: ragged masks, mismatched train/rollout log-probs, 0/1 rewards with one constant group."""
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).float()
    logp_rollout = -torch.rand(batch, seq, generator=g) * 3
    logp_train_old = logp_rollout + 0.3 * torch.randn(batch, seq, generator=g)
    logp_new = logp_train_old + 0.2 * torch.randn(batch, seq, generator=g)
    rewards = torch.randint(0, 2, (batch,), generator=g).float()
    rewards[GROUP_SIZE:2 * GROUP_SIZE] = 1.0
    return {"mask": mask, "logp_rollout": logp_rollout, "logp_train_old": logp_train_old, "logp_new": logp_new,
            "rewards": rewards}


def compute(b: dict[str, torch.Tensor], group=None) -> dict:
    """Everything compared across the split: the same code path for one process (group=None) and for ranks."""
    from megatron_qrl.rl import count_valid_tokens, grpo_advantages, is_weights, policy_loss

    out = {"adv": grpo_advantages(b["rewards"], GROUP_SIZE, group=group)}
    for name, cfg in METHOD_CFGS:
        key = name + ("_seq" if cfg.get("mis_level") == "sequence" else "")
        w, stats = is_weights(b["logp_train_old"], b["logp_rollout"], out["adv"], b["mask"], name, cfg, group)
        out[f"w_{key}"], out[f"stats_{key}"] = w, stats
    ntok = count_valid_tokens(b["mask"], group)
    logp_new = b["logp_new"].clone().requires_grad_(True)
    loss, _ = policy_loss(logp_new, b["logp_train_old"], out["adv"], b["mask"], out["w_ais"], 0.2, 0.28,
                          num_tokens_global=ntok)
    loss.backward()
    out.update(loss=loss.detach(), grad=logp_new.grad, ntok=ntok)
    return out


def main(outfile: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    full = make_batch()
    rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
    local = {k: v[rows] for k, v in full.items()}
    torch.save(compute(local, dist.group.WORLD), f"{outfile}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
