"""Routed experts for QAT: Megatron's SequentialMLP with the per-expert activation amax made layout-exact.

With sequence parallelism each TP rank routes only its sequence shard. When TP > EP*ETP the experts
are replicated across TP peers and each replica sees only its own rank's tokens, so a per-tensor
activation amax computed locally would differ from the amax of the expert's whole input (what one
process computes). `QATSequentialMLP` runs the experts in two phases (all fc1, then all fc2) and
all-reduces (MAX) a [num_experts] vector of input amaxes over the TP group before each phase; every
expert then quantizes with the amax of its full input. Entries of experts a rank does not hold are 0,
so the same reduction is a no-op when the TP group is already inside the EP x ETP group.
Without TP, or when the experts do not quantize activations, it is exactly Megatron's SequentialMLP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.experts import SequentialMLP


def _activation(config, x: torch.Tensor) -> torch.Tensor:
    """Megatron MLP's unfused activation (gated linear unit with clamp/offset, or plain)."""
    if config.gated_linear_unit:
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if (val := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)
    return config.activation_func(x)


class QATSequentialMLP(SequentialMLP):
    """SequentialMLP whose expert activation scales are computed over the expert's full input."""

    def _needs_amax_reduction(self) -> bool:
        group = ps.get_tensor_model_parallel_group()
        if group is None or group.size() == 1 or not self.local_experts:
            return False
        q = getattr(self.local_experts[0].linear_fc1, "quant", None)
        return bool(q is not None and q.enabled and q.activations and q.format == "nvfp4")

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self._needs_amax_reduction() or self.config.moe_apply_probs_on_input:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = torch.as_tensor(tokens_per_expert).tolist()
        tokens = torch.split(permuted_local_hidden_states, counts)
        probs = torch.split(permuted_probs, counts)
        first = self.ep_group.rank() * self.num_local_experts
        n_global = self.ep_group.size() * self.num_local_experts

        def reduced_amax(inputs):
            amax = torch.zeros(n_global, dtype=torch.float32, device=permuted_local_hidden_states.device)
            for j, t in enumerate(inputs):
                if t.numel():
                    amax[first + j] = t.detach().abs().amax().float()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
            return amax

        amax1 = reduced_amax(tokens)
        hidden = []
        for j, (expert, t, p) in enumerate(zip(self.local_experts, tokens, probs)):
            expert.linear_fc1.site.amax_floor = amax1[first + j]
            try:
                h, bias = expert.linear_fc1(t)
            finally:
                expert.linear_fc1.site.amax_floor = None
            if bias is not None:
                h = h + bias
            h = _activation(self.config, h)
            hidden.append((h * p.unsqueeze(-1)).to(h.dtype))
        amax2 = reduced_amax(hidden)
        outputs = []
        for j, (expert, h) in enumerate(zip(self.local_experts, hidden)):
            expert.linear_fc2.site.amax_floor = amax2[first + j]
            try:
                out, bias = expert.linear_fc2(h)
            finally:
                expert.linear_fc2.site.amax_floor = None
            if bias is not None:
                out = out + bias
            outputs.append(out)
        return torch.cat(outputs, dim=0), None
