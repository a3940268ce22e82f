"""One RL prompt with what the verifier and the SFT warm start need."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """prompt: text given to the policy; answer: reference for the verifier (text);
    response: an SFT target (a correct response, "" when unknown); meta: task data (countdown numbers/target,
    source row index, ...). Rewards read answer, then meta."""

    prompt: str
    answer: str
    response: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    task: str = ""
