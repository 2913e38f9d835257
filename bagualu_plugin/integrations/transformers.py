"""HF Trainer and TRL: adaptive activation memory as a `TrainerCallback`.

    trainer = SFTTrainer(model=model, args=SFTConfig(..., gradient_checkpointing=False),
                         train_dataset=dataset, callbacks=[BagualuCallback()])
    trainer.train()

At train begin the callback derives the recipe from the model, the device, the process group and
the training arguments (gradient-accumulation steps, per-device batch, TRL's `max_length`), with
whatever `recipe` gives winning (on CPU at least `{"hardware": {"capacity_bytes": ...}}`), and
installs a Provisioner on the model (`callback.provisioner`); the Trainer's loop runs unchanged,
each micro-batch found on the model (`runtime.boundaries`). At train end it removes itself; the
Provisioner's events stay readable, and unless the recipe turns telemetry off they are in
`bagualu-telemetry.jsonl` in the output directory (`bagualu report OUTPUT_DIR` draws them). Its
figures go into each of the Trainer's log records (`state.log_history`) and to every `report_to`
integration (TensorBoard, W&B, MLflow, ...): it logs before them, whatever order it was given in.

`UnplannedCallback` is the same run's memory without the plugin (counted, not limited), for sizing
the capacity or comparing.

Expert parallelism (`recipe={"parallel": {"ep": N}}` over all N processes) must shard the experts
before the Trainer wraps the model in DDP: the callback does it at the end of the Trainer's
`__init__` (`on_init_end`), so pass it to the constructor. Under FSDP2 or DeepSpeed ZeRO the
engine's sharding prices each rank's weights, gradients and optimizer state (`engines`).
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from ..adapters import Adapter
from ..adapters.costs import model_cost
from ..costmodel import CostModel, ForwardKind
from ..derive import PartialRecipe, derive_recipe
from ..runtime.ledger import Ledger
from ..runtime.provisioner import Provisioner
from ..runtime.static_memory import StaticMemory
from ..runtime.unhooked_head import UnhookedHead
from ..stage import Stage
from .accelerate import shard_experts_for_ddp
from .engines import engine, trainer_budget

# training arguments that would make a second owner of recompute, offload, the saved tensors or the loss (the first
# name is the one the error tells the user to set; transformers 5 also spells it the second way)
_REFUSED = {
    ("gradient_checkpointing", "activation_checkpointing"): "it recomputes whole layers (TRL's SFTConfig turns it on by "
    "default), and the plugin plans recompute per operator",
    ("activation_offloading",): "it offloads every saved activation (TRL), and the plugin plans offload per operator",
    ("torch_compile",): "it compiles the model, whose graphs would trace the plugin's op scopes and recompute regions and "
    "save what their own partitioner chooses",
    ("use_liger_kernel",): "Liger replaces the model's norms, MLPs and loss with kernels the plugin's operators and loss runner "
    "do not know (for a loss without full logits use the recipe's strategies.loss_chunk_tokens)",
}


class BagualuCallback(TrainerCallback):
    def __init__(self, recipe: PartialRecipe = None, cost: CostModel | None = None):
        """`recipe`: what the derived recipe should not derive (a partial dict, a YAML path or a
        full `Recipe`); `cost`: the model's cost model (default: the analytic one)."""
        self.recipe, self.cost = recipe, cost
        self.provisioner: Provisioner | None = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        _check_arguments(args)
        _log_first(self)
        given = self.recipe.get("parallel", {}) if isinstance(self.recipe, dict) else {}
        if given.get("ep", 1) > 1:
            sharding = engine(_accelerator_state())
            if sharding is not None:
                raise ValueError(
                    f"BagualuCallback: parallel.ep={given['ep']}: expert parallelism runs inside DistributedDataParallel, "
                    f"but the Trainer runs {sharding}, which shards the experts itself; drop parallel.ep"
                )
            shard_experts_for_ddp(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _check_arguments(args)
        _log_first(self)  # added after the Trainer's init
        accelerator = _accelerator_state()
        planned = self.cost is None  # a given cost model describes plain forwards only
        kind = ForwardKind(fused_head=planned and _fused_head(model), autocast=_autocast(accelerator) if planned else None)
        budget = trainer_budget(args, accelerator, model)
        recipe = derive_recipe(model, self.recipe, training_args=args, budget=budget).with_output_dir(args.output_dir or ".")
        self.provisioner = Provisioner(model, recipe, self.cost, kind)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.provisioner is not None and logs is not None:
            _log(state, logs, self.provisioner.figures())

    def on_train_end(self, args, state, control, **kwargs):
        if self.provisioner is not None:
            self.provisioner.remove()


class UnplannedCallback(TrainerCallback):
    """What the same run needs without the plugin, for sizing it or comparing with it: each step's
    saved activations counted by a Ledger (nothing planned, nothing limited) on top of the
    weights, gradients and optimizer state, as `bagualu/unplanned_peak_device_bytes` in the logs.
    Those are measured, as the plugin measures them; under FSDP2 or DeepSpeed, whose shards and
    buffers are not the parameters' storages, priced from the engine's config, as the plugin
    prices them, so that a capacity sized on this figure means the same to the plugin."""

    def __init__(self):
        self.peaks: list[int] = []  # per optimizer step: static and activation bytes together
        self.static_bytes: list[int] = []  # per optimizer step, at its start
        self._stack = ExitStack()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _log_first(self)
        self.ledger = Ledger.for_model(model)
        adapter = Adapter(model)
        self.static = StaticMemory(adapter.model, self.ledger)
        self.static.watch(lambda: None)  # counts an optimizer's state from its first step
        budget = trainer_budget(args, _accelerator_state(), model)
        self.priced = _priced_static(model, args, budget) if budget else None
        # TRL's fused head under ZeRO-3: counted off its graph (`runtime.unhooked_head`)
        self._head = UnhookedHead(adapter.model, adapter.decoder, self.ledger, lambda pack: pack == self.ledger.pack).install()

    def on_step_begin(self, args, state, control, **kwargs):
        self.ledger.reset_peak(allocator=False)
        # the optimizer's state so far, the gradients to come
        self.static_bytes.append(self.static.measure() if self.priced is None else self.priced)
        self._stack.enter_context(self.ledger.track())

    def on_step_end(self, args, state, control, **kwargs):
        self._stack.close()
        self.peaks.append(self.static_bytes[-1] + self.ledger.peak_device_bytes)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.peaks:
            _log(state, logs, {"bagualu/unplanned_peak_device_bytes": self.peaks[-1]})

    def on_train_end(self, args, state, control, **kwargs):
        self._stack.close()
        self.static.remove()
        self._head.remove()


def _priced_static(model, args, budget: dict) -> int:
    """The static bytes the plugin prices for this rank under a sharding engine's `budget`
    (`Stage.of`, as the Provisioner takes them); the capacity plays no part in them."""
    recipe = derive_recipe(model, {"hardware": {"capacity_bytes": 2**62}}, training_args=args, budget=budget)
    return Stage.of(recipe, model_cost(model, recipe.hardware), split=False).static_bytes


def _log(state, logs: dict, figures: dict) -> None:
    """Into the logs later callbacks get, and into the record Trainer.log made of them."""
    logs.update(figures)
    if state.log_history and all(state.log_history[-1].get(k) == v for k, v in logs.items() if k not in figures):
        state.log_history[-1].update(figures)


def _log_first(callback: TrainerCallback) -> None:
    """Move `callback` to the front of the Trainer's callbacks, so that the records it adds its
    figures to reach the `report_to` integrations, which the Trainer puts before the callbacks it
    is given. The handler is the one whose event is calling: found on the stack (it does not pass
    itself to its callbacks). Moving the running callback to the front keeps the indices of those
    after it, so the event in progress calls each of them once."""
    frame = inspect.currentframe().f_back
    for _ in range(4):
        if frame is None:
            return
        handler = frame.f_locals.get("self")
        if isinstance(handler, CallbackHandler) and callback in handler.callbacks:
            handler.callbacks.remove(callback)
            handler.callbacks.insert(0, callback)
            return
        frame = frame.f_back


def _accelerator_state() -> AcceleratorState | None:
    """The Trainer's accelerate state (a process-wide singleton), None before one exists."""
    return AcceleratorState() if AcceleratorState._shared_state else None


def _autocast(accelerator: AcceleratorState | None) -> str | None:
    """The dtype of the autocast the Trainer runs each forward under (bf16=True, TRL's default, or
    fp16=True), as accelerate decides it: accelerate enters it inside the model's forward, where no
    pre-hook of the model sees it. None without mixed precision, and where accelerate runs none:
    under DeepSpeed or Megatron-LM (which cast the model themselves), and FP16 on a CPU."""
    if accelerator is None or accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        return None
    precision = str(accelerator.mixed_precision)
    if precision == "fp16" and accelerator.device.type == "cpu":
        return None
    return precision if precision in ("bf16", "fp16") else None


def _fused_head(model) -> bool:
    """Whether TRL's fused LM head is on the model (SFTTrainer adds it in its `__init__`): every
    training forward then runs with it, so the floor is checked for such forwards from the start."""
    forward = Adapter(model).model.forward
    while forward is not None:  # under wrappers of its own (accelerate's autocast), each `functools.wraps`'d
        if "fused_lm_head" in inspect.signature(forward, follow_wrapped=False).parameters:
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def _check_arguments(args) -> None:
    refused = [
        f"{names[0]}=True: {why}; pass {names[0]}=False"
        for names, why in _REFUSED.items()
        if any(getattr(args, name, False) for name in names)
    ]
    fsdp = getattr(args, "fsdp_config", None) or {}
    if fsdp.get("activation_checkpointing"):
        refused.append("fsdp_config.activation_checkpointing=True: it recomputes whole layers; set it to False")
    if refused:
        raise ValueError("BagualuCallback: " + "; ".join(refused))
