"""The converting load of a full-weight model into QeRL mode (models/lora.py load_full_state): the frozen base
of every LoRA linear is the NVFP4 packing of the full weight, everything else is copied, and with B = 0 the
LoRA model computes what the full-weight W4A4 QAT model computes (the QeRL arm's start in
tools/evidence.py equals the FP4 arms' start)."""
import pytest
import torch

from megatron_qrl.config import from_dict

TINY = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                  "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64, "ffn_hidden_size": 64,
                  "vocab_size": 64, "max_sequence_length": 64},
        "quant": {"targets": "all_linears"},
        "trainer": {"micro_batch_size": 2, "use_distributed_optimizer": False},
        "trace": {"enabled": False}, "r3": {"enabled": False}, "aqn": {"enabled": False}}


def test_full_state_into_lora_packs_the_base_and_keeps_the_forward():
    from megatron_qrl.models.lora import is_lora_linear, load_full_state
    from megatron_qrl.quant import nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize
    from megatron_qrl.trainer import Trainer

    full = Trainer(from_dict(TINY))
    with torch.no_grad():                                   # weights unlike any fresh init
        for p in full.unwrapped[0].parameters():
            p.add_(torch.randn_like(p) * 0.05)
    lora = Trainer(from_dict({**TINY, "lora": {"enabled": True, "rank": 4}}))
    state = full.unwrapped[0].state_dict()
    missing = load_full_state(lora.unwrapped, state)
    assert missing and all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in missing)
    linears = {n: m for n, m in lora.unwrapped[0].named_modules() if is_lora_linear(m)}
    assert len(linears) == 2 * (2 + 2 * 4)                  # qkv, proj and 4 experts x (fc1, fc2) per layer
    for name, lin in linears.items():
        w = state[f"{name}.weight"].float()
        packed, scales, gs = nvfp4_quantize(w, nvfp4_global_scale(w.abs().max()))[:3]
        assert torch.equal(lin.base_weight(torch.float32), nvfp4_dequantize(packed, scales, gs, dtype=torch.float32))
    lora_params = dict(lora.unwrapped[0].named_parameters())
    assert torch.equal(lora_params["embedding.word_embeddings.weight"], state["embedding.word_embeddings.weight"])
    tokens = torch.randint(0, 64, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        want = full.unwrapped[0](tokens, pos, None)
        got = lora.unwrapped[0](tokens, pos, None)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)   # B = 0: the packed base is the QAT weight
    with pytest.raises(KeyError, match="without lora.enabled"):
        load_full_state(lora.unwrapped, {k: v for k, v in state.items() if "linear_qkv" not in k})
