"""TRL's fused LM head under DeepSpeed ZeRO-3, counted without saved-tensor hooks.

TRL's fused head (`trl.trainer.utils.add_fused_lm_head`, which SFTTrainer installs) saves the LM
head's weight for backward and, under ZeRO-3, reads DeepSpeed's marks on the saved weight in
backward to gather it again (`maybe_gather_lm_head_ctx`). A tensor saved under any saved-tensor hook
comes back from autograd as a new tensor object without those marks, so under the plugin's hooks
(the Ledger's count, the plan's) that backward fails (`'Tensor' object has no attribute
'ds_status'`). The head is the part of the forward after the backbone: nothing in it can be
mitigated (the function is TRL's), so it runs with no hooks, and its saves are read off the
autograd nodes it made once the model's forward returns: each is counted by the Ledger from then
until its node has run in backward (a node hook lets go of it), as the hooks would have counted it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .ledger import Ledger, _storage
from .outputs import grad_fns
from .replay import top_hooks


def _next_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread is given (or a larger one)."""
    with torch.enable_grad():
        return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1


_PROBES = {torch.float64: torch.float16, torch.int64: torch.int8}


def _python_number(tensor: torch.Tensor) -> bool:
    """A Python number an op wrapped as a tensor (`x * 2.0`): autograd saves it past the hooks, so
    they never count it. It is the one zero-dim tensor that never raises the dtype of another
    zero-dim one (torch's type promotion puts Python numbers last)."""
    probe = _PROBES.get(tensor.dtype)
    return probe is not None and tensor.dim() == 0 and torch.result_type(torch.zeros((), dtype=probe), tensor) == probe


def _saved(node) -> list[torch.Tensor]:
    """The tensors `node` keeps for its backward, as saved-tensor hooks would have seen them: a
    custom function's `saved_tensors`, a built-in node's `_saved_*` fields."""
    if hasattr(node, "saved_tensors"):
        values = list(node.saved_tensors)
    else:
        values = []
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                values += value if isinstance(value, (tuple, list)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor) and not _python_number(v)]


class UnhookedHead:
    """On `model` (its backbone `decoder`): a forward with `fused_lm_head=True` over ZeRO-3
    parameters runs its head without the saved-tensor hooks in force at the backbone's end when
    they are `ours(pack)`; they are back in force when the model's forward returns, and the head's
    saves are counted on `ledger` (after `before_count()`, which names the op they are charged to)."""

    def __init__(self, model: nn.Module, decoder: nn.Module, ledger: Ledger, ours: Callable[[Callable], bool],
                 before_count: Callable[[], None] = lambda: None):
        self._model, self._decoder, self._ledger, self._ours, self._before_count = model, decoder, ledger, ours, before_count
        self._fused = self._paused = None  # this forward's: TRL's head asked for; the hooks taken off and the node mark
        self._zero3 = None  # whether ZeRO-3 partitions the model, read at its first fused forward (after the engine's set-up)
        self._handles = []

    def install(self) -> UnhookedHead:
        self._handles = [
            self._model.register_forward_pre_hook(self._begin, with_kwargs=True),
            self._decoder.register_forward_hook(self._pause),
            # before other hooks that end the forward (the Provisioner's boundaries) take their hooks off
            self._model.register_forward_hook(self._resume, prepend=True, always_call=True),
        ]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _begin(self, _model, _args, kwargs) -> None:
        self._fused = kwargs.get("fused_lm_head") is True and torch.is_grad_enabled()

    def _pause(self, *_) -> None:
        if not self._fused or self._paused is not None:
            return
        if self._zero3 is None:
            self._zero3 = any(hasattr(p, "ds_id") for p in self._model.parameters())
        pack, unpack = top_hooks()
        if self._zero3 and self._ours(pack):
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._paused = (pack, unpack, _next_sequence_nr())

    def _resume(self, _model, _args, output) -> None:
        self._fused, paused, self._paused = None, self._paused, None
        if paused is None:
            return
        pack, unpack, mark = paused
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        if output is None:  # the forward raised
            return
        self._before_count()
        # ZeRO-3 keeps small parameters whole (its persistence threshold): the saved LM head weight may be one
        params = {found[0] for p in self._model.parameters() if (found := _storage(p)) is not None}
        seen, todo = {}, grad_fns(output)  # held while walking: a wrapper's id is not reused
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen or type(node).__name__ == "AccumulateGrad" or node._sequence_nr() < mark:
                continue
            seen[id(node)] = node
            todo += [fn for fn, _ in node.next_functions]
            kept = [t for t in _saved(node) if (found := _storage(t)) is None or found[0] not in params]
            for tensor in kept:
                self._ledger.record(tensor)
            if kept:  # run in backward: its saved tensors go, and so do these
                node.register_hook(lambda *_, kept=kept: kept.clear())
