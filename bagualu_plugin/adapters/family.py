"""What differs between HF MoE families is data: the attribute names of the router and the shared
expert, where attention's projections end, and how to build a tiny config. `Family` holds it; one
code path (`adapter.py`) reads it for every family (DESIGN.md section 7)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    model_type: str  # HF config.model_type
    router: str  # attribute of the MoE block holding the router (gate)
    tiny_config: Callable[..., Any] = field(repr=False)  # config of a tiny random model, kwargs override
    shared: tuple[str, ...] = ()  # MoE-block children that form the shared_expert op
    qkv_last: tuple[str, ...] = ("v_proj",)  # the first of these in self_attn is the last projection
