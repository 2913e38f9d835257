"""What kind of forward a micro-batch runs, where that changes what it keeps
(`costmodel.ForwardKind`), read off the arguments the model is called with; each kind has its
own cost model (`adapters.costs.model_cost`)."""

from __future__ import annotations

import torch

from ..adapters.costs import DTYPES
from ..costmodel import ForwardKind
from .ledger import _storage


def autocast_dtype(dtype: torch.dtype) -> str:
    """The cost model's name of an autocast dtype; another is an error naming the supported."""
    name = DTYPES.get(dtype)
    if name not in ("bf16", "fp16"):
        raise ValueError(f"autocast to {dtype} is not modelled; expected torch.bfloat16 or torch.float16")
    return name


def forward_kind(kwargs: dict) -> ForwardKind:
    """The kind of a forward called with `kwargs`. Masked: padding in `attention_mask`, a mask of
    the caller's own, or several sequences packed in a row (position ids that restart), as
    transformers' mask functions decide. Fused head: `fused_lm_head=True` (TRL's SFTTrainer).
    Loss divisor: the bytes of a `num_items_in_batch` tensor (the Trainer's), which the loss keeps.
    Router aux loss: `output_router_logits=True` (TRL asks for it), over a given attention mask or all tokens.
    Loss: `labels` given."""
    mask, positions, items = kwargs.get("attention_mask"), kwargs.get("position_ids"), kwargs.get("num_items_in_batch")
    masked = isinstance(mask, torch.Tensor) and (mask.dim() != 2 or not bool(mask.all()))
    packed = isinstance(positions, torch.Tensor) and positions.dim() == 2 and bool((positions[:, 1:] <= positions[:, :-1]).any())
    divisor = items.untyped_storage().nbytes() if isinstance(items, torch.Tensor) else 0
    aux = "none" if kwargs.get("output_router_logits") is not True else "all_tokens" if mask is None else "attention_mask"
    loss = kwargs.get("labels") is not None
    return ForwardKind(masked or packed, kwargs.get("fused_lm_head") is True, divisor, aux, loss=loss)


VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")  # flash-attention's varlen arguments, through every layer


def varlen_bytes(kwargs: dict) -> int:
    """The bytes of the varlen arguments a forward is given (TRL's padding-free packing passes
    them: each text's start and a text index per token), each storage once: the layers receive
    them, and a recompute region holding a layer's arguments keeps them; the cost model does not
    know their size, which depends on how many texts are packed."""
    storages = dict(found for name in VARLEN if isinstance(kwargs.get(name), torch.Tensor) and (found := _storage(kwargs[name])))
    return sum(storages.values())
