"""A frozen reference policy for the KL term, evaluated by the trainer under the policy's own layout.

    ref = ReferencePolicy(trainer)                         # the trainer's current weights, frozen
    ref = ReferencePolicy.from_checkpoint(trainer, path)   # the weights of a checkpoint (any saved layout)
    logp_ref = ref.logprobs(batch)                         # [B, T], like Trainer.logprobs, no gradient

Why a weight swap instead of a second model: the reference must be sharded exactly like the policy (TP, PP,
EP, the same micro-batching and pipeline schedule) and run the same numerics (FP4 QAT, R3 replay of the
batch's expert ids, the step's AQN draw in the norm buffers). Keeping only a copy of the weights and running
the policy's own modules gives that by construction (slime keeps its reference the same way) and costs one
copy of this rank's shards of the *trainable* parameters (frozen ones, such as a LoRA base, are the
reference's by definition), no second set of modules, DDP buffers or optimizer. `logprobs` swaps the reference into the parameters in place (the
policy's values go into the store), runs Trainer.logprobs and swaps back: the policy is restored bit for bit,
and the optimizer's own copies (fp32 main params, Adam state) are never touched. TRACE guides are not used:
they replay the rollout's rounding for the policy's activations, not the reference's.
offload=True keeps the store in CPU memory (pinned when CUDA is present) between uses.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch


def _trainable(trainer) -> list[torch.nn.Parameter]:
    return [p for chunk in trainer.model for p in chunk.parameters() if p.requires_grad]


def _everything(trainer) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of this rank's model chunks (what a checkpoint load may overwrite)."""
    out = []
    for i, chunk in enumerate(trainer.model):
        out += [(f"{i}.{n}", t) for n, t in chunk.named_parameters()]
        out += [(f"{i}.{n}", t) for n, t in chunk.named_buffers()]
    return out


def load_model_weights(trainer, path: str | Path) -> None:
    """The model weights of checkpoint `path` into `trainer`'s modules; nothing else (optimizer state, LR
    schedule, step, RNG) changes. Collective like Trainer.load: with trainer=None (an engine rank of a
    disaggregated job) this rank only joins the checksum verification and the read."""
    from megatron.core import dist_checkpointing

    from megatron_qrl.models import weights_changed
    from megatron_qrl.platform import cpu as cpu_shim

    from . import checkpoint as ckpt

    if trainer is None:
        ckpt.load(None, path)
        return
    cpu_shim.install()
    path = Path(path).absolute()
    manifest = ckpt.read_manifest(path)
    ckpt.verify_checkpoint(path, manifest)
    saved, mine = manifest.get("model", {}), trainer.cfg.model.model_dump()
    diff = [k for k in ("num_layers", "hidden_size", "num_experts", "vocab_size", "num_attention_heads",
                        "num_query_groups", "moe_ffn_hidden_size") if saved.get(k) != mine.get(k)]
    if diff:
        raise ckpt.CheckpointError(f"reference checkpoint '{path}' was saved for a different model ({', '.join(diff)} "
                                   "differ): rl.kl_reference must hold this run's model")
    module = trainer.model[0].module
    loaded = dist_checkpointing.load({"model": module.sharded_state_dict()}, str(path))
    module.load_state_dict(loaded["model"], strict=True)
    weights_changed()


class ReferencePolicy:
    """Frozen copy of the trainable weights of `trainer` (see the module docstring)."""

    def __init__(self, trainer, offload: bool = False):
        self.trainer = trainer
        self.offload = offload
        self._params = _trainable(trainer)
        pin = offload and torch.cuda.is_available()
        with torch.no_grad():
            self._store = [p.detach().to("cpu", copy=True).pin_memory() if pin else
                           p.detach().to("cpu" if offload else p.device, copy=True) for p in self._params]

    @classmethod
    def from_checkpoint(cls, trainer, path: str | Path, offload: bool = False) -> Optional["ReferencePolicy"]:
        """The weights of checkpoint `path` as the reference; the trainer's own weights are unchanged
        afterwards. Collective (see load_model_weights); returns None on a rank without a trainer."""
        if trainer is None:
            load_model_weights(None, path)
            return None
        from megatron_qrl.models import weights_changed

        tensors = _everything(trainer)
        with torch.no_grad():   # in CPU memory: at start-up the device may hold a colocated engine too
            stash = [t.detach().to("cpu", copy=True) for _, t in tensors]
        try:
            load_model_weights(trainer, path)
            frozen = [name for (name, t), old in zip(tensors, stash)
                      if not getattr(t, "requires_grad", False) and not torch.equal(t.cpu(), old)]
            if frozen:
                raise ValueError(f"reference checkpoint '{path}' has other frozen weights than this run "
                                 f"({len(frozen)} tensors, e.g. {frozen[0]}): the reference may differ from the "
                                 "policy only in trained parameters; point rl.kl_reference at a checkpoint of "
                                 "this model (the same LoRA base)")
            ref = cls(trainer, offload)
        finally:
            with torch.no_grad():
                for (_, t), old in zip(tensors, stash):
                    t.copy_(old)
            weights_changed()
        return ref

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._store)

    @torch.no_grad()
    def _swap(self) -> None:
        """Exchange the parameters' values with the store's (bit-exact both ways)."""
        from megatron_qrl.models import weights_changed

        for p, r in zip(self._params, self._store):
            held = p.detach().to(r.device, copy=True)
            p.copy_(r)
            r.copy_(held)
        weights_changed()   # the FP4 linears' cached fake-quant weights belong to the other weights now

    def logprobs(self, batch: dict) -> torch.Tensor:
        """Trainer.logprobs(batch) under the reference weights; the policy's weights are back on return.
        The reference's routing does not enter r3/router_agreement (the policy's statistic)."""
        routers = getattr(self.trainer, "routers", [])
        counts = [(r.agreement_hits, r.agreement_total) for r in routers]
        replay = getattr(self.trainer, "trace", None)   # TRACE replays the policy's rollout, not the reference
        self.trainer.trace = None
        self._swap()
        try:
            return self.trainer.logprobs(batch)
        finally:
            self._swap()
            self.trainer.trace = replay
            for r, (hits, total) in zip(routers, counts):
                r.agreement_hits, r.agreement_total = hits, total
