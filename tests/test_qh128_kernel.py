"""The Triton qh128 kernel (kernels/qh128.py, run by the Triton interpreter here) against the torch path and
the pure-Python definition of quant/digest.py: the same lane sums, so the same digests on every device."""
import torch

from megatron_qrl.kernels.qh128 import BLOCK, qh128_lane_sums
from megatron_qrl.quant import digest as D


def _words(tensors):
    raw, per = [], []
    for t in tensors:
        b = D._byte_view(t)
        pad = -b.numel() % 4
        raw += [b] + ([torch.zeros(pad, dtype=torch.uint8)] if pad else [])
        per.append((b.numel() + pad) // 4)
    return torch.cat(raw).view(torch.int32), per


def _kernel_digests(tensors):
    words, per = _words(tensors)
    sums = qh128_lane_sums(words, per, D._LANES).tolist()
    return [D._finish(D._header(t), lane) for t, lane in zip(tensors, sums)]


def test_kernel_digests_equal_torch_and_reference():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(BLOCK + 7, generator=g),                      # two blocks, the second partial
               torch.randint(0, 255, (37,), dtype=torch.uint8, generator=g),   # padded to a word
               torch.randn(3, 7, generator=g).to(torch.bfloat16),
               torch.zeros(0), torch.full((2 * BLOCK,), -1, dtype=torch.int32)]
    got = _kernel_digests(tensors)
    assert got == D.tensor_digests(tensors)
    assert got[:3] == [D.reference_qh128(t) for t in tensors[:3]]


def test_kernel_digest_sees_one_flipped_bit_and_position():
    t = torch.randn(BLOCK * 2 + 3, generator=torch.Generator().manual_seed(1))
    flipped = t.clone()
    flipped.view(torch.int32)[BLOCK + 5] ^= 1 << 17
    swapped = t.clone()
    swapped[[3, BLOCK + 9]] = swapped[[BLOCK + 9, 3]]     # same words, other positions
    a, b, c = _kernel_digests([t, flipped, swapped])
    assert a != b and a != c
