"""policy/entropy: the per-token entropy of the trainer's policy on the rollout tokens (docs/metrics.md), from
hand-computed distributions, over a vocabulary split across two gloo ranks, through grpo_loss's global token
mean, and on a real one-process Megatron trainer against the entropy of its own logits."""
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_qrl.config import RLConfig, from_dict
from megatron_qrl.pipeline.losses import grpo_loss
from megatron_qrl.rl.entropy import masked_token_mean, token_aligned, vocab_parallel_entropy


def test_entropy_of_hand_computed_distributions():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0],                       # uniform over 4: ln 4
                           [math.log(2.0), 0.0, 0.0, -math.inf],       # p = 1/2, 1/4, 1/4, 0: 1.5 ln 2
                           [1000.0, 0.0, 0.0, 0.0]])                   # one-hot up to e^-1000: 0, no overflow
    h = vocab_parallel_entropy(logits)
    assert h.tolist() == pytest.approx([math.log(4.0), 1.5 * math.log(2.0), 0.0], abs=1e-6)
    assert h.dtype == torch.float32 and vocab_parallel_entropy(logits.bfloat16()).dtype == torch.float32


def test_token_aligned_and_masked_mean():
    per_position = torch.tensor([[1.0, 2.0, 3.0, 4.0]])           # H of the distribution at positions 0..3
    aligned = token_aligned(per_position)                           # token t was drawn from position t-1
    assert aligned.tolist() == [[0.0, 1.0, 2.0, 3.0]]
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0]])                     # prompt, prompt, response, response
    assert float(masked_token_mean(aligned, mask)) == pytest.approx(2.5)
    assert float(masked_token_mean(aligned, mask, num_tokens=5)) == pytest.approx(1.0)   # (2 + 3) / 5


def _shard_worker(rank: int, port: int, logits: torch.Tensor, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        half = logits.shape[-1] // 2
        h = vocab_parallel_entropy(logits[..., rank * half:(rank + 1) * half], dist.group.WORLD)
        out[rank] = h.tolist()
    finally:
        dist.destroy_process_group()


def test_vocab_split_over_two_ranks_equals_the_full_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 8) * 4
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_shard_worker, args=(port, logits, out), nprocs=2, join=True)
    p = torch.softmax(logits, -1)
    want = -(p * torch.log_softmax(logits, -1)).sum(-1)
    for rank in (0, 1):
        assert torch.tensor(out[rank]) == pytest.approx(want, abs=1e-5)


def test_grpo_loss_reports_the_global_token_mean():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    mb = {"logp_old": torch.zeros(2, 3), "advantages": torch.zeros(2), "loss_mask": mask, "num_global_tokens": 6.0,
          "policy_entropy": torch.tensor([[9.0, 1.0, 2.0], [9.0, 3.0, 9.0]])}
    _, stats = grpo_loss(RLConfig())(torch.zeros(2, 3), mb)
    assert float(stats["policy/entropy"]) == pytest.approx((1.0 + 2.0 + 3.0) / 6.0)   # this micro-batch's share
    mb.pop("policy_entropy")
    assert "policy/entropy" not in grpo_loss(RLConfig())(torch.zeros(2, 3), mb)[1]


TINY = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                  "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64, "ffn_hidden_size": 64,
                  "vocab_size": 64, "max_sequence_length": 64},
        "trainer": {"micro_batch_size": 2, "use_distributed_optimizer": False, "lr": 1e-3},
        "trace": {"enabled": False}, "r3": {"enabled": False}, "aqn": {"enabled": False}}


def test_trainer_update_pass_logs_the_entropy_of_its_logits():
    from megatron_qrl.trainer import Trainer

    tr = Trainer(from_dict(TINY))
    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (3, 7))
    mask = torch.zeros(3, 7)
    mask[:, 4:] = 1.0                                               # the "response" tokens
    with torch.no_grad():
        logits = tr.unwrapped[0](tokens, torch.arange(7).expand(3, 7), None)      # [b, s, V], no labels
    want = float(masked_token_mean(token_aligned(vocab_parallel_entropy(logits)), mask))
    assert 0.5 < want < math.log(64) + 1e-4
    batch = {"tokens": tokens, "loss_mask": mask, "logp_old": tr.logprobs({"tokens": tokens}),
             "advantages": torch.tensor([1.0, -1.0, 0.5])}
    stats = tr.train_step(batch, grpo_loss(RLConfig(is_method="none")))
    assert stats["policy/entropy"] == pytest.approx(want, rel=1e-5)   # summed over 2 micro-batches (+ padding)
    assert tr.entropy.take() is None and not tr.entropy.armed


def test_entropy_probe_hooks_through_precision_and_ddp_wrappers(monkeypatch):
    """The trainer wraps its chunks (Float16Module under bf16, then DDP): the probe must still find the output
    layer (on the H200 runs it did not, and policy/entropy was missing from every GPU run's metrics)."""
    from megatron_qrl.trainer import entropy_probe
    from megatron_qrl.trainer.entropy_probe import EntropyProbe

    monkeypatch.setattr(entropy_probe.ps, "get_tensor_model_parallel_group", lambda: None)   # one rank, no TP

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.output_layer = torch.nn.Linear(4, 6, bias=False)

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = Model()
    probe = EntropyProbe([Wrapper(Wrapper(model))])
    probe.armed = True
    model.output_layer(torch.randn(3, 2, 4))          # [s, b, h] -> logits [s, b, V]
    h = probe.take()
    assert h is not None and h.shape == (2, 3) and torch.all(h[:, 1:] > 0)
