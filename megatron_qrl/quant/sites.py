"""Names of quantized activation sites: the one grammar the trainer, the engine and the TRACE cache share.

A site is one FP4-quantized linear input: 'L{layer}.{role}' for dense sites, 'L{layer}.{role}.E{expert}'
for routed experts (global 0-based layer and expert indices; roles qkv, proj, fc1, fc2, shared_fc1,
shared_fc2). The models name their linears with `site_name`; TRACE keys and capture records are read
back with `parse_site_name`.
"""
from __future__ import annotations

import re
from typing import NamedTuple, Optional

SITE_NAME = re.compile(r"^L(\d+)\.([A-Za-z_][A-Za-z0-9_]*?)(?:\.E(\d+))?$")


class SiteId(NamedTuple):
    layer: int
    role: str
    expert: Optional[int] = None      # None: a dense site


def site_name(layer: int, role: str, expert: Optional[int] = None) -> str:
    """'L3.fc1.E17', 'L0.qkv'."""
    return f"L{layer}.{role}" + (f".E{expert}" if expert is not None else "")


def parse_site_name(name: str) -> SiteId:
    """The (layer, role, expert) a site name stands for; ValueError naming the grammar when it is none."""
    m = SITE_NAME.match(name)
    if m is None:
        raise ValueError(f"'{name}' is not a site name of the form 'L<layer>.<role>[.E<expert>]' "
                         "(megatron_qrl.quant.sites.site_name builds them)")
    return SiteId(int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3) is not None else None)


__all__ = ["SITE_NAME", "SiteId", "parse_site_name", "site_name"]
