"""What a user of this stack reaches for instead when a job runs out of memory, as policies of the
payoff table (`gpu_payoff.py`), run like its policies without plans: on the same batches, at the
same capacity, with the Ledger counting what each keeps (on CPU it also enforces the capacity).

- hf_checkpointing: transformers' gradient checkpointing (`gradient_checkpointing=True` of the
  Trainer, `model.gradient_checkpointing_enable()`), non-reentrant as TRL's SFTConfig sets it:
  every decoder layer keeps its inputs and recomputes the rest;
- torch_sac: torch's selective activation checkpointing (`create_selective_checkpoint_contexts`)
  on every decoder layer with torchtitan's op policy: the attention kernels', max's and
  reduce-scatter's outputs and every second matmul's saved, the rest recomputed;
- trl_offloading: TRL's activation offloading (`activation_offloading=True`), which moves every
  saved tensor of 1 KiB or more to pinned host memory; it needs an accelerator (on CPU it is
  reported as GPU only).

A pipeline rank keeps several micro-batches in flight (1F1B) where TRL's trainer runs one forward
and its backward at a time: each micro-batch's forward gets its own `OffloadActivations` (TRL's
state holds one micro-batch), entered around that forward only, so its stream synchronisation
comes after the forward instead of after the backward (one per micro-batch, as in TRL). What each
alternative installs is taken back when the job restarts after an out-of-memory error, under full
recompute as every other policy.
"""

from __future__ import annotations

import traceback
import warnings
from contextlib import ExitStack, contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from bagualu_plugin.demo.policies import PolicyRun

ALTERNATIVES = ("hf_checkpointing", "torch_sac", "trl_offloading")
GPU_ONLY = {"trl_offloading": "TRL's OffloadActivations needs an accelerator (torch.accelerator)"}
_SAVED = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def _sac_always_saved() -> frozenset:
    """The ops torchtitan's op-level policy always saves: the attention kernels (CPU's flash kernel
    too), max (fp8 scales) and reduce-scatter, those this torch has."""
    names = [("aten", "_scaled_dot_product_efficient_attention"), ("aten", "_scaled_dot_product_flash_attention"),
             ("aten", "_scaled_dot_product_cudnn_attention"), ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
             ("aten", "max"), ("_c10d_functional", "reduce_scatter_tensor")]
    return frozenset(getattr(getattr(torch.ops, ns), op).default for ns, op in names if hasattr(getattr(torch.ops, ns), op))


def sac_policy():
    """One checkpointed region's policy: the always-saved ops, and of the matmuls every second one
    (the first, third, ...), counted apart in the forward and in the recompute so both decide alike
    (a torch before 2.12 asks the policy again while it recomputes)."""
    always, mm = _sac_always_saved(), torch.ops.aten.mm.default
    matmuls = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in always:
            return CheckpointPolicy.MUST_SAVE
        if func is mm:
            matmuls[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if matmuls[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Charged(TorchDispatchMode):
    """Above torch's caching mode: what the policy just saved is charged to the Ledger, as a tensor
    `kept` holds until the region recomputes. SAC's cache keeps the outputs itself, where no
    saved-tensor hook sees them."""

    def __init__(self, decided: list, kept: list, ledger):
        super().__init__()
        self.decided, self.kept, self.ledger = decided, kept, ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.decided[0] = None
        out = func(*args, **(kwargs or {}))
        if self.decided[0] in _SAVED:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    alias = t.detach()
                    self.ledger.record(alias)
                    self.kept.append(alias)
        return out


def sac_contexts(ledger_of):
    """`checkpoint`'s `context_fn` for one region: torch's selective-checkpoint contexts under
    `sac_policy`, the cache's tensors charged to `ledger_of()`'s Ledger until the recompute, which
    takes them back."""

    def context_fn():
        decided, kept, policy = [None], [], sac_policy()

        def deciding(ctx, func, *args, **kwargs):
            decided[0] = policy(ctx, func, *args, **kwargs)
            return decided[0]

        caching, cached = create_selective_checkpoint_contexts(deciding)

        @contextmanager
        def forward():
            with caching, _Charged(decided, kept, ledger_of()):
                yield

        @contextmanager
        def recompute():
            kept.clear()  # the cache's tensors go into the recomputed graph and die in its backward
            with cached:
                yield

        return forward(), recompute()

    return context_fn


def _checkpointing(model: torch.nn.Module, kwargs: dict) -> None:
    """transformers' checkpointing of every decoder layer with `kwargs` for torch's `checkpoint`
    (`activation_checkpointing_enable` where the release has it, else its older name)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the older name's deprecation
        enable(kwargs)


def _no_checkpointing(model: torch.nn.Module) -> None:
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        disable()


class AlternativeRun(PolicyRun):
    """`alternative` on this rank: the policy "none" (no plan, the Ledger counting) with the
    alternative installed on its model; after an out-of-memory restart, full recompute without it."""

    def __init__(self, alternative: str, stage, schedule, batches, start, hot: int):
        if alternative not in ALTERNATIVES:
            raise ValueError(f"alternative must be one of {ALTERNATIVES}, got {alternative!r}")
        if alternative in GPU_ONLY and batches[0].device.type == "cpu":
            raise ValueError(f"{alternative} runs on a GPU only: {GPU_ONLY[alternative]}")
        self.alternative, self._undo, self.error = alternative, [], None
        super().__init__("none", stage, schedule, batches, start, hot)
        self.result.policy = alternative

    def iteration(self, it: int) -> None:
        """`PolicyRun.iteration`; an error other than running out of memory (another library's, on
        a stack it was not made for) ends this alternative alone, its text kept in `error`."""
        if self.error is not None:
            return
        try:
            super().iteration(it)
        except Exception as exc:  # noqa: BLE001 - the table says what failed; the other policies go on
            traceback.print_exc()
            self.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
            self.close()

    def _install(self) -> None:
        super()._install()
        if self.current != "none":  # restarted: full recompute, as every policy
            return
        model = self.model
        if self.alternative == "hf_checkpointing":
            _checkpointing(model, {"use_reentrant": False})
            self._undo.append(lambda: _no_checkpointing(model))
        elif self.alternative == "torch_sac":
            _checkpointing(model, {"use_reentrant": False, "context_fn": sac_contexts(lambda: self.runner.ledger)})
            self._undo.append(lambda: _no_checkpointing(model))
        else:
            from trl.models.activation_offloading import get_act_offloading_ctx_manager

            # TRL's own set-up: the output head runs without offloading (hooks on it, taken back on close)
            hooks = [(m, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]
            get_act_offloading_ctx_manager(model)
            self._undo.append(lambda: _take_back_hooks(hooks))

    def _forward(self):
        if self.alternative != "trl_offloading" or self.current != "none":
            return super()._forward()
        from trl.models.activation_offloading import OffloadActivations

        stack = ExitStack()
        stack.enter_context(super()._forward())
        stack.enter_context(OffloadActivations())  # inside the Ledger's hooks: TRL packs what is saved
        return stack

    def close(self):
        while self._undo:
            self._undo.pop()()
        return super().close()


def _take_back_hooks(before: list) -> None:
    """Remove the forward hooks added to each module since `before` was taken."""
    for module, pre, post in before:
        for added in set(module._forward_pre_hooks) - set(pre):
            del module._forward_pre_hooks[added]
        for added in set(module._forward_hooks) - set(post):
            del module._forward_hooks[added]
