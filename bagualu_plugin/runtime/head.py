"""The loss runner: HF's LM head and the model's own loss function run as one function, so a
plan can recompute them (the head's `graph.LOSS_OPS` unit and span) and the chunked loss can
replace them (`runtime.chunked_loss`).

HF computes the loss inside the CausalLM's forward, from logits it has already made. While the
runner is needed and labels are given, a forward pre-hook passes `logits_to_keep` as an empty
index, so HF's forward projects no position (outside autocast: autocast would keep a low-precision
copy of the weight for that empty product); the final norm's output is taken as it leaves the
norm, and the model's `loss_function` is replaced by one that runs
`loss_function(lm_head(hidden), labels, ...)` (or the chunked loss) through the runtime's
recompute region. The returned `logits` are then empty (batch x 0 x vocabulary), as with
Liger-Kernel's fused loss: train on `.loss`. Without labels, or without gradients (evaluation,
which saves nothing to mitigate), the forward is HF's own.

An engine that runs the model's modules itself (a pipeline's last stage) calls the runner
directly: `head_loss(model)` is it while installed, HF's head and loss function otherwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import ExitStack

import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from ..adapters import Adapter, is_inside_backward
from .chunked_loss import chunked_causal_lm_loss

Region = Callable[[Callable, tuple, dict], torch.Tensor]  # runs forward(*args, **kwargs) as the plan says
HEAD_ATTR = "_bagualu_head_loss"  # the installed runner, on the CausalLM


def head_loss(model) -> Callable[..., torch.Tensor]:
    """`loss(hidden, labels, **kwargs)` of the final norm's output `hidden`: the installed
    runner (the plan's head region, the chunked loss), else `model`'s LM head and loss function."""
    runner = getattr(model, HEAD_ATTR, None)
    if runner is not None:
        return runner
    return lambda hidden, labels, **kwargs: model.loss_function(model.lm_head(hidden), labels, model.config.vocab_size, **kwargs)


def install_loss_runner(adapter: Adapter, needed: Callable[[], bool], region: Region, chunk: int | None, stack: ExitStack) -> None:
    """Install the runner on `adapter`'s model until `stack` closes. `needed()`: whether the
    current plan needs it (a region of the LM head and loss, or the chunked loss); `region`: how
    the runtime runs the head's loss region; `chunk`: tokens per chunk of the chunked loss."""
    model, lm_head = adapter.model, adapter.model.lm_head
    original = model.loss_function
    if chunk is not None and original is not ForCausalLMLoss:
        raise ValueError(
            f"loss_chunk_tokens replaces transformers' ForCausalLMLoss, but this model's loss_function is {original!r}"
        )
    signature = inspect.signature(model.forward)
    state: dict[str, torch.Tensor | bool | None] = {"armed": False, "hidden": None}

    def arm(_module, args, kwargs):
        state["armed"], state["hidden"] = False, None
        given = signature.bind_partial(*args, **kwargs).arguments
        if given.get("labels") is None or not torch.is_grad_enabled() or not needed():
            return None
        if "logits_to_keep" in given:
            raise ValueError(
                "logits_to_keep was passed with labels while the plan recomputes the LM head's loss or "
                "loss_chunk_tokens is set: the loss runner decides which logits to make"
            )
        state["armed"] = True
        return args, {**kwargs, "logits_to_keep": torch.empty(0, dtype=torch.long, device=lm_head.weight.device)}

    def take_hidden(_module, _args, output):
        if state["armed"] and not is_inside_backward():  # a region replaying the norm ahead of backward
            state["hidden"] = output

    def disarm(*_):
        state["armed"], state["hidden"] = False, None

    empty = ExitStack()  # the empty projection's autocast, off

    def uncast(_module, args):
        if state["armed"] and args and args[0].shape[-2] == 0:
            empty.enter_context(torch.autocast(args[0].device.type, enabled=False))

    def recast(*_):
        empty.close()

    vocab_size = adapter.config.vocab_size

    def head_and_loss(h, y, **kw):
        if chunk is not None:
            return chunked_causal_lm_loss(h, lm_head, y, chunk, **kw)
        return original(lm_head(h), y, vocab_size, **kw)

    def runner(hidden, labels, **kwargs):
        return region(head_and_loss, (hidden, labels), kwargs)

    def loss_function(logits, labels, vocab_size, **kwargs):
        hidden = state["hidden"]
        if hidden is None:
            return original(logits, labels, vocab_size, **kwargs)
        state["hidden"] = None
        return runner(hidden, labels, **kwargs)

    had, previous = "_loss_function" in model.__dict__, model.__dict__.get("_loss_function")
    model.loss_function = loss_function  # HF's property sets the instance's _loss_function

    def take_back() -> None:
        """Only what is still ours: a loss function set after ours stays."""
        if model.__dict__.get("_loss_function") is loss_function:
            if had:
                model._loss_function = previous
            else:
                del model._loss_function

    setattr(model, HEAD_ATTR, runner)
    stack.callback(delattr, model, HEAD_ATTR)
    stack.callback(take_back)
    stack.callback(model.register_forward_pre_hook(arm, with_kwargs=True).remove)
    stack.callback(model.register_forward_hook(disarm).remove)
    stack.callback(adapter.decoder.norm.register_forward_hook(take_hidden).remove)
    stack.callback(lm_head.register_forward_pre_hook(uncast).remove)
    stack.callback(lm_head.register_forward_hook(recast, always_call=True).remove)
