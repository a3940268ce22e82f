"""How per-token loss terms become one loss: the normalisation modes peers name (verl's loss_agg_mode).

    token-mean            sum_t term_t / N_tok                 every token weighs the same (default)
    seq-mean-token-mean   mean_i (sum_{t in i} term_t / n_i)   every response weighs the same
    seq-mean-token-sum    mean_i  sum_{t in i} term_t          = sum_t term_t / N_seq (Dr. GRPO-style,
                                                               long responses weigh more)
N_tok = valid tokens of the whole optimizer-step batch, N_seq = its responses with at least one valid token,
n_i = valid tokens of response i. Each mode is a per-token coefficient c_t with loss = sum_t c_t * term_t,
built from the global counts: summed over micro-batches and data-parallel ranks it gives exactly the loss of
one process on the whole batch, whatever the split (a row never spans micro-batches).
"""
from __future__ import annotations

import torch

from megatron_qrl.rl.reduce import all_reduce_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def check_mode(mode: str) -> str:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation '{mode}'; choose one of {', '.join(LOSS_AGG_MODES)} "
                         "(rl.loss_agg_mode)")
    return mode


def count_loss_sequences(mask: torch.Tensor, group=None) -> int:
    """Responses with at least one valid token over the whole batch (N_seq); all-reduced over `group`."""
    n = (mask.detach().ne(0).sum(-1) > 0).to(torch.float64).sum().reshape(1)
    return int(all_reduce_sum(n, group).item())


def token_coefficients(mask: torch.Tensor, mode: str, num_tokens_global: float, num_sequences_global: float,
                       dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """c_t [B, T] for a (micro-)batch: 0 off the mask, else 1/N_tok, 1/(n_i N_seq) or 1/N_seq."""
    check_mode(mode)
    valid = mask.detach().ne(0).to(dtype)
    if mode == "token-mean":
        return valid / max(float(num_tokens_global), 1.0)
    n_seq = max(float(num_sequences_global), 1.0)
    if mode == "seq-mean-token-sum":
        return valid / n_seq
    per_row = valid.sum(-1, keepdim=True).clamp_min(1.0)
    return valid / (per_row * n_seq)
