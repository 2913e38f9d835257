"""Where a micro-batch begins and ends, found on the model itself (`pipeline.pp` 1: gradient
accumulation under HF Trainer / TRL, Accelerate, DDP, FSDP or a plain loop), so no training loop
has to change.

- It begins at the HF model's forward when gradients are enabled and the model has a parameter
  that requires them, whatever `model.training` says (`from_pretrained` returns a model in eval
  mode, and a loop that never calls `train()` still trains it); an evaluation, `generate` or a
  forward under `torch.no_grad` is not a micro-batch. Not inside another one's forward (PEFT's
  wrapper calling the base model counts once) or backward.
- Its forward ends where the HF forward returns (the loss is computed inside it).
- Its backward ends when autograd has finished the graph its outputs belong to: a callback queued
  on the autograd engine from the outputs' `grad_fn`, as DDP finalises its reduction.

A forward whose outputs never go backward, or a step that raises, leaves nothing behind: the next
micro-batch abandons it (`Provisioner.abandon`) and begins a new optimizer step.
`explicit(input_ids)` is the same for a loop that wants to say it (`Provisioner.micro_batch`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from ..adapters import is_inside_backward
from ..costmodel import Forward, ForwardKind
from .forward_kind import autocast_dtype, forward_kind, varlen_bytes
from .outputs import UNCOMPILED, compiled, grad_fns


class Provisioning(Protocol):
    """What the boundaries need of the adaptive system (the `Provisioner`): its model and device,
    the micro-batches of an optimizer step, and each micro-batch's forward and backward begun,
    ended or abandoned."""

    runtime: object  # its `adapter` holds the model and its decoder
    ledger: object  # its `device`
    recipe: object  # its `pipeline.micro_batches`

    @property
    def running_kind(self) -> ForwardKind | None: ...
    def awaits_backward(self, mb: int | None = None) -> bool: ...
    def rekind(self, kind: ForwardKind) -> None: ...
    def begin_forward(self, mb: int, forward: Forward, **kw) -> object: ...
    def end_forward(self, mb: int) -> int: ...
    def end_backward(self, mb: int) -> int: ...
    def abandon(self) -> None: ...


class Boundaries:
    def __init__(self, provisioner: Provisioning, autocast: str | None = None):
        """`autocast`: the dtype of the autocast the model's forward enters itself (accelerate's
        wrapper, for the Trainer's bf16=True or fp16=True), which its pre-hooks cannot see; else
        learnt at the first forward's decoder."""
        self._prov = provisioner
        model = provisioner.runtime.adapter.model
        self.index = 0  # the next micro-batch of the optimizer step: 0 .. pipeline.micro_batches - 1
        self._depth = 0  # model forwards running, nested ones included
        self._began: int | None = None  # the micro-batch this object began, while its forward runs
        self._awaited: object = None  # the token of the micro-batch whose backward is awaited
        self._explicit = False  # inside an explicit() block
        self._handles = [
            # first of the model's pre-hooks: the micro-batch's plan is set before the runtime's own
            # hooks read it (the loss runner arms for a plan that recomputes the LM head's loss)
            model.register_forward_pre_hook(self._before, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._after, with_kwargs=True, always_call=True),
            provisioner.runtime.adapter.decoder.register_forward_pre_hook(self._autocast),  # inside an autocast wrapper
        ]
        self._inner = autocast  # the autocast entered inside the model's forward
        self._outside = False  # whether the running forward's kind saw autocast on already

    def _kind(self, kwargs: dict) -> ForwardKind:
        """`forward_kind(kwargs)`, run under the autocast that is on now or that the model's
        forward enters."""
        self._outside = torch.is_autocast_enabled(self._prov.ledger.device.type)
        return forward_kind(kwargs)._replace(autocast=self._running() if self._outside else self._inner)

    def _running(self) -> str | None:
        """The dtype autocast computes in on the Ledger's device now (None: off)."""
        device = self._prov.ledger.device.type
        return autocast_dtype(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None

    def _before(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():  # traced: refused before anything begins (torch 2.11's tracer fails inside begin_forward)
            raise RuntimeError(UNCOMPILED)
        self._depth += 1
        prov = self._prov
        if self._depth > 1 or self._explicit or prov.running_kind is not None:
            return  # nested, or a micro-batch someone else began
        if not torch.is_grad_enabled() or is_inside_backward() or not _trainable(model):
            return
        tokens, seq_len = _shape(model, args, kwargs)
        self._fresh()
        forward = Forward(tokens, seq_len, kind=self._kind(kwargs))
        prov.begin_forward(self.index, forward, ids=_ids(args, kwargs), varlen_bytes=varlen_bytes(kwargs))
        self._began = self.index

    def _autocast(self, decoder: nn.Module, args: tuple) -> None:
        """At the decoder, inside whatever wraps the model's forward, before anything is saved:
        autocast entered there (by accelerate, for the Trainer's bf16=True or fp16=True) or no
        longer entered corrects the running forward's kind (`Provisioner.rekind`) and is
        expected of the next."""
        kind = self._prov.running_kind
        if kind is None:
            return
        now = self._running()
        if not self._outside:
            self._inner = now
        if kind.autocast != now:
            self._prov.rekind(kind._replace(autocast=now))

    def _after(self, model: nn.Module, args: tuple, kwargs: dict, output) -> None:
        self._depth -= 1
        if self._depth or self._began is None:
            return
        mb, self._began = self._began, None
        roots = grad_fns(output)  # None output: the forward raised (always_call)
        if output is None or not roots:
            self._drop()
            return
        if compiled(output):  # before its backward replays anything
            self._drop()
            raise RuntimeError(UNCOMPILED)
        self._prov.end_forward(mb)
        token = self._awaited = object()
        queued = []

        def backward_started(*_) -> None:
            if not queued:  # once per graph, however many outputs it reaches
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_ended(mb, token))

        for fn in roots:
            fn.register_prehook(backward_started)

    def _backward_ended(self, mb: int, token: object) -> None:
        if token is self._awaited and self._prov.awaits_backward(mb):
            self._awaited = None
            self._prov.end_backward(mb)
            self.index = (mb + 1) % self._prov.recipe.pipeline.micro_batches

    def _fresh(self) -> None:
        """Before a micro-batch begins: an earlier one whose outputs never went backward is dropped."""
        if self._prov.awaits_backward():
            self._drop()

    def _drop(self) -> None:
        self._prov.abandon()
        self._awaited, self.index = None, 0

    @contextmanager
    def explicit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Iterator[int]:
        """One micro-batch whose forward and backward run inside the block; yields its index in the
        optimizer step. The forward ends where the HF model's forward returns, so the backward in
        the block runs under no plan's hooks."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"micro_batch(input_ids): expected the (batch, sequence) token ids, got {input_ids!r:.80}")
        prov = self._prov
        self._fresh()
        mb = self.index
        forward = Forward(input_ids.numel(), input_ids.shape[-1], kind=self._kind({"attention_mask": attention_mask}))
        prov.begin_forward(mb, forward, ids=input_ids)
        forwards = []

        def ended(_model, _args, output):
            if forwards:
                raise ValueError(f"micro_batch({mb}): the model ran a second forward inside one micro-batch")
            if torch.compiler.is_compiling() or compiled(output):  # traced, or the graph it made
                raise RuntimeError(UNCOMPILED)  # the block drops the micro-batch
            forwards.append(prov.end_forward(mb))

        hook = prov.runtime.adapter.model.register_forward_hook(ended)
        self._explicit = True
        try:
            yield mb
        except BaseException:
            self._drop()
            raise
        finally:
            hook.remove()
            self._explicit = False
        if not forwards:
            self._drop()
            raise ValueError(f"micro_batch({mb}): the model ran no forward inside the block")
        prov.end_backward(mb)
        self.index = (mb + 1) % prov.recipe.pipeline.micro_batches

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _trainable(model: nn.Module) -> bool:
    """Whether a parameter of `model` requires gradients (a frozen model's forward goes nowhere)."""
    return any(p.requires_grad for p in model.parameters())


def _ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A forward's (batch, sequence) `input_ids`, if it was given them."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def _shape(model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(tokens, sequence length) of a forward's `input_ids`, or of its `inputs_embeds`."""
    ids = _ids(args, kwargs)
    if ids is not None:
        return ids.numel(), ids.shape[-1]
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() == 3:
        return embeds.shape[0] * embeds.shape[1], embeds.shape[1]
    raise ValueError(
        f"bagualu: a training forward of {type(model).__name__} got neither input_ids (batch, sequence) nor inputs_embeds "
        "(batch, sequence, hidden): each micro-batch is planned for its shape"
    )
