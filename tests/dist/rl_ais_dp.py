"""2-rank gloo check: RL statistics on a data-parallel split equal the single-process result.

Run: python -m torch.distributed.run --nproc_per_node 2 --master_port P tests/dist/rl_ais_dp.py OUT
Each rank takes an uneven, group-splitting slice of one deterministic batch (rows [0, 7) and [7, 12) with
group_size 4), computes advantages, IS weights and statistics (mismatch metrics included) for every method at
the token and sequence levels, and the globally normalised policy loss (every loss aggregation mode, with a KL
term to a reference) and its gradient, and saves them to OUT.rank<r>; tests/test_rl_distributed.py compares
with one process.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

GROUP_SIZE = 4
SPLIT = 7
CFG = {"C": 2.0, "delta": 0.05, "gamma": 1.0, "beta": 0.5, "tis_C": 2.0, "mis_U": 1.3, "mis_level": "token",
       "icepop_low": 0.8, "icepop_high": 1.25}
# windows that cut into this batch's response ratios (rho_seq spans ~0.39-3.3, rho_geo ~0.85-1.8)
SEQ_CFGS = {"seq": {**CFG, "tis_C": 1.5, "mis_U": 2.5, "icepop_low": 0.5, "icepop_high": 1.6, "C": 1.5,
                    "delta": 0.5, "is_level": "seq"},
            "geo": {**CFG, "tis_C": 1.2, "mis_U": 1.25, "icepop_low": 0.9, "icepop_high": 1.2, "C": 1.2,
                    "delta": 0.5, "is_level": "geo"}}
METHOD_CFGS = [("none", CFG), ("tis", CFG), ("mis", CFG), ("mis", {**CFG, "mis_level": "sequence"}),
               ("icepop", CFG), ("ais", CFG)]
METHOD_CFGS += [(m, SEQ_CFGS[lv]) for lv in ("seq", "geo") for m in ("tis", "mis", "icepop", "ais")]
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def key_of(name: str, cfg: dict) -> str:
    """Result key of one (method, config): its name and level."""
    level = "sequence" if cfg.get("mis_level") == "sequence" else cfg.get("is_level", "token")
    return f"{name}_{level}"


def make_batch(batch: int = 12, seq: int = 6) -> dict[str, torch.Tensor]:
    """Deterministic batch: ragged masks, mismatched train/rollout log-probs, 0/1 rewards with one constant group."""
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).float()
    logp_rollout = -torch.rand(batch, seq, generator=g) * 3
    logp_train_old = logp_rollout + 0.3 * torch.randn(batch, seq, generator=g)
    logp_new = logp_train_old + 0.2 * torch.randn(batch, seq, generator=g)
    logp_ref = logp_train_old + 0.5 * torch.randn(batch, seq, generator=g)
    rewards = torch.randint(0, 2, (batch,), generator=g).float()
    rewards[GROUP_SIZE:2 * GROUP_SIZE] = 1.0
    return {"mask": mask, "logp_rollout": logp_rollout, "logp_train_old": logp_train_old, "logp_new": logp_new,
            "logp_ref": logp_ref, "rewards": rewards}


def compute(b: dict[str, torch.Tensor], group=None) -> dict:
    """Everything compared across the split: the same code path for one process (group=None) and for ranks."""
    from megatron_qrl.rl import (count_loss_sequences, count_valid_tokens, grpo_advantages, is_weights, policy_loss,
                                 token_coefficients)

    out = {"adv": grpo_advantages(b["rewards"], GROUP_SIZE, group=group)}
    for name, cfg in METHOD_CFGS:
        key = key_of(name, cfg)
        w, stats = is_weights(b["logp_train_old"], b["logp_rollout"], out["adv"], b["mask"], name, cfg, group)
        out[f"w_{key}"], out[f"stats_{key}"] = w, stats
    ntok, nseq = count_valid_tokens(b["mask"], group), count_loss_sequences(b["mask"], group)
    for mode in LOSS_AGG_MODES:
        logp_new = b["logp_new"].clone().requires_grad_(True)
        coef = token_coefficients(b["mask"], mode, ntok, nseq)
        loss, _ = policy_loss(logp_new, b["logp_train_old"], out["adv"], b["mask"], out["w_ais_token"], 0.2, 0.28,
                              token_coef=coef, logp_ref=b["logp_ref"], kl_coef=0.05, kl_estimator="k3")
        loss.backward()
        out[f"loss_{mode}"], out[f"grad_{mode}"] = loss.detach(), logp_new.grad
    logp_new = b["logp_new"].clone().requires_grad_(True)
    loss, _ = policy_loss(logp_new, b["logp_train_old"], out["adv"], b["mask"], out["w_ais_token"], 0.2, 0.28,
                          num_tokens_global=ntok)
    loss.backward()
    out.update(loss=loss.detach(), grad=logp_new.grad, ntok=ntok, nseq=nseq)
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
