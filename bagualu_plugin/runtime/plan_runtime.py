"""`PlanRuntime` and `apply_plan`: the per-operator mitigation of saved activations installed on a
model (paper §IV-B, §V-A; docs/architecture.md).

- keep: the Ledger's pack (a detached alias, counted on the device);
- offload / fp8: the saved storage kept in another form (`runtime.storage`) by the plan's
  saved-tensor hooks (`runtime.hooks`);
- recompute: the op's recompute unit (`costmodel.graph.standard_units`) runs under our checkpoint
  (`runtime.replay`): a module's forward, or an expert op through the experts' runner. An op no
  unit covers alone (attention's three, Qwen2-MoE's gated shared expert) goes through its span
  (`standard_spans`): the attention module's or MoE block's forward under a checkpoint that takes
  only the recomputed ops' saves (`runtime.regions`). A region's inputs stay on the device, as
  the cost model holds them; `PlanRuntime.recover` replays a layer's regions ahead of its
  backward (paper §V-B). The LM head and loss run through the loss runner (`runtime.head`),
  also to realise `MitigationOptions.loss_chunk_tokens`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from functools import cache

import torch
from torch import nn

from ..adapters import Adapter, OpTracker, is_inside_backward
from ..adapters.experts import RUNNER_ATTR, adapted_weights, require_plain_weights
from ..adapters.units import block_spans, block_units, unit_module
from ..costmodel.graph import LOSS_OPS, OpId
from ..costmodel.mitigation import MitigationOptions, cover
from ..costmodel.plan import Block, Plan
from .head import install_loss_runner
from .hooks import SavedTensorHooks
from .ledger import Ledger, _storage
from .patches import Patches
from .regions import SpanSaves, bagualu_experts, region
from .replay import top_hooks
from .storage import HostPool
from .unhooked_head import UnhookedHead


class PlanRuntime:
    """The mitigation mechanisms installed on a model once, following a plan that may change
    between micro-batches and even within one, at the gate (deferred planning, paper §V-A):
    every recompute unit's and span's module is wrapped and every experts module gets a runner,
    each checking the current plan when it runs; saved tensors are handled inside `forward()`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        ledger: Ledger | None = None,
        options: MitigationOptions = MitigationOptions(),
        capacity_bytes: int | None = None,
        static_bytes: int = 0,
    ):
        """`ledger`: count into this one; otherwise a new Ledger of the model with the given
        (simulated) capacity and static bytes."""
        self.adapter = Adapter(model)
        require_plain_weights(self.adapter.config)
        self.options = options
        self.tracker = OpTracker(self.adapter, active=False)  # on inside forward() only
        self.ledger = ledger or Ledger.for_model(
            self.adapter.model,
            capacity_bytes=capacity_bytes,
            static_bytes=static_bytes,
            current_op=lambda: self.tracker.current,
        )
        self.hooks = SavedTensorHooks(Plan(), self.ledger, lambda: self.tracker.current, options, HostPool())
        self._regions: dict[tuple[int, tuple[str, ...]], frozenset[str]] = {}
        # set_plan's, per layer and its block of the plan: a layer takes few blocks (those of
        # Algorithm 2's paths and the gates' escalations of them), where whole plans, combining
        # every layer's, keep coming new over a long run with spikes
        self.block_regions = cache(self._regions_of)
        self._ops = frozenset(self.adapter.ops())
        self.micro_batches = self.ledger.micro_batches  # each one's regions, among its state
        self._stack: ExitStack | None = None
        self._forwarding: str | None = None  # inside forward(), only where the plan applies: "stored" or "counted"
        self._arguments_op: OpId | None = None  # the op running before this forward's first decoder layer
        self._enclosing: list[tuple] = []  # each region module with its (pre-hook, hook) handles: `_enclose`
        self.patches: Patches | None = None  # what other libraries changed on the model, checked at each forward
        self._returned: set[nn.Module] = set()  # the experts whose forward returned in this forward, and those that ran our ops
        self._dispatched: set[nn.Module] = set()

    @property
    def plan(self) -> Plan:
        return self.hooks.plan

    def set_plan(self, plan: Mapping) -> None:
        """Follow `plan` from now on (validated first: unknown ops, units that cannot recompute)."""
        plan = plan if isinstance(plan, Plan) else Plan(plan)
        if self._forwarding == "counted" and plan.stores:
            raise ValueError(
                "set_plan: the plan offloads or stores in FP8 while a forward runs that began under one storing nothing, "
                "whose saves are only counted: set it before the forward"
            )
        self._regions, self.hooks.plan = self.regions(plan), plan

    def regions(self, plan: Plan) -> dict[tuple[int, tuple[str, ...]], frozenset[str]]:
        """`plan` validated and the checkpoint regions of its recompute, per (layer, ops): what
        each drops. Each layer's block of a plan is validated and its regions found once
        (`block_regions`): the Provisioner has every block its plans may run found ahead."""
        regions = {}
        for layer, block in plan.blocks().items():
            regions.update(self.block_regions(layer, block))
        return regions

    def _regions_of(self, layer: int, block: Block) -> dict[tuple[int, tuple[str, ...]], frozenset[str]]:
        """The checkpoint regions of `layer`'s recompute under its `block` of a plan, per (layer,
        ops): what each drops."""
        unknown = [f"{layer}.{name}" for name, _ in block if OpId(layer, name) not in self._ops]
        if unknown:
            raise KeyError(f"plan names ops this {self.adapter.family.model_type} model does not have: {', '.join(unknown)}")
        wanted = {name for name, strategy in block if strategy == "recompute"}
        regions = {}
        if wanted:
            units, spans = block_units(self.adapter, layer), block_spans(self.adapter, layer)
            try:
                covered = cover(units, spans, wanted, f"layer {layer}")
            except ValueError as error:
                if layer < 0 or layer >= len(self.adapter.layers) or not self.adapter.layers[layer].expert_parallel:
                    raise
                raise ValueError(
                    f"{error}. Under expert parallelism dispatch and combine (all-to-alls that every rank must join) are "
                    "recomputed only with the routed experts between them, as one region on every rank at once: "
                    "dispatch, expert_fc1, expert_act, expert_fc2 and combine together"
                ) from None
            for region in covered:
                regions[(layer, region.ops)] = frozenset(region.dropped)
        return regions

    def agree_on_collectives(self) -> None:
        """Under expert parallelism, refuse a plan whose recompute regions hold the all-to-alls of
        a layer on some ranks of the expert group and not on others: backward replays them on
        those ranks only, which never meet the others' (gloo fails on the sizes, NCCL hangs).
        One exchange of each rank's collective regions over the group, so every rank raises the
        same error, naming the layer, its ops and the ranks, before any forward. The adaptive
        system agrees at each gate instead (`planner.gate`)."""
        group = self.adapter.expert_group
        if group is None or group.size == 1:
            return
        mine = sorted((layer, ops) for (layer, ops) in self._regions if "dispatch" in ops)
        every = [None] * group.size
        torch.distributed.all_gather_object(every, mine, group=group.group)
        split = sorted({region for regions in every for region in regions} - set.intersection(*map(set, every)))
        if split:
            lines = [
                f"layer {layer} ({', '.join(ops)}) on rank(s) {[r for r, regions in enumerate(every) if (layer, ops) in regions]} only"
                for layer, ops in split
            ]
            raise ValueError(
                "apply_plan: the plan recomputes the experts with their all-to-alls (dispatch and combine) on some ranks of "
                f"the expert-parallel group of {group.size} and not on the others: {'; '.join(lines)}. Every rank's backward "
                "would have to join those all-to-alls; give every rank the same recompute of these layers' routed experts"
            )

    def install(self) -> PlanRuntime:
        a, stack = self.adapter, ExitStack()
        head, lm_head = a.head_index, a.model.lm_head
        install_loss_runner(  # first: it checks the model's loss function before installing anything
            a,
            lambda: self.options.loss_chunk_tokens is not None or (head, LOSS_OPS) in self._regions,
            lambda forward, args, kwargs: self._run(lm_head, head, LOSS_OPS, forward, args, kwargs),
            self.options.loss_chunk_tokens,
            stack,
        )
        for layer in [-1, *(part.index for part in a.layers), a.head_index]:
            for unit in dict.fromkeys((*block_units(a, layer), *block_spans(a, layer))):
                module = unit_module(a, layer, unit)
                if module is not None:  # expert ops and the loss have runners that run their regions
                    self._wrap(module, layer, unit, stack)
        for part in a.layers:
            if part.experts is not None:
                setattr(part.experts, RUNNER_ATTR, self._runner(part.index))
                stack.callback(delattr, part.experts, RUNNER_ATTR)
                stack.callback(part.experts.register_forward_hook(self._experts_returned).remove)
        # the op scopes and the plan's module hooks, once: they do nothing outside forward()
        self.tracker.install()
        stack.callback(self.tracker.remove)
        # TRL's fused head under ZeRO-3: counted off its graph, nothing of it being a plan's
        ours = (self.hooks.pack, self.ledger.pack)
        unhooked = UnhookedHead(a.model, a.decoder, self.ledger, lambda pack: bool(self._forwarding) and pack in ours,
                                lambda: self.tracker.enter(OpId(head, "loss")))
        stack.callback(unhooked.install().remove)
        stack.callback(a.model.register_forward_pre_hook(self._new_forward).remove)
        if a.decoder.norm is not None:
            stack.callback(a.decoder.norm.register_forward_pre_hook(self._end_charges).remove)
        for part in a.layers:
            # before the layer's own region (a whole-layer recompute) saves its arguments
            stack.callback(part.module.register_forward_pre_hook(self._layer_inputs, with_kwargs=True, prepend=True).remove)
        stack.callback(self._enclosing.clear)
        hooked = [a.model, a.decoder.norm, *(module for module, _, _ in self._enclosing), *(part.module for part in a.layers),
                  *(part.experts for part in a.layers)]
        self.patches = Patches(a, [module for module in hooked if module is not None])
        self._stack = stack
        return self

    def _enclose(self) -> None:
        """Each region's hooks around every other library's hook on its module, also those
        registered since (prepended or not): the region holds what they run, and its replay, a
        call of the module, runs them again. Only the plugin's own hooks (the loss runner's, the
        op scopes', the layer arguments') may come before the region's pre-hook or after its hook.
        Dicts are reordered only where another library's hook is out of place (torch 2.11's
        compiler fails on a model whose hook dicts were reordered)."""
        for _, pre, post in self._enclosing:
            _around(pre.hooks_dict_ref(), pre.id, last=False)
            _around(post.hooks_dict_ref(), post.id, last=True)

    def _experts_returned(self, experts: nn.Module, *_) -> None:
        if self._forwarding and not is_inside_backward():
            self._returned.add(experts)

    def _end_charges(self, *_) -> None:
        if self._forwarding and not is_inside_backward():
            self.ledger.end_charges()

    def _new_forward(self, *_) -> None:
        if self._forwarding:
            self.hooks.new_forward()

    def _layer_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The layer arguments are made before the first decoder layer (a later layer's mask
        too): charged to the op running then. Not again when a region replays the layer."""
        if self._forwarding and not is_inside_backward():
            if module is self.adapter.layers[0].module:
                self._arguments_op = self.tracker.current
            self.hooks.layer_inputs(args, kwargs, self._arguments_op)

    def _wrap(self, module: nn.Module, layer: int, unit: tuple[str, ...], stack: ExitStack) -> None:
        """Run `module` as a recompute region while its unit or span is one: a forward pre-hook
        before every other library's opens the region, a forward hook after them (always called,
        also when the forward raises) closes it (`_enclose` keeps them so), and the replay calls the module with the
        arguments it was called with: whatever forward it has then and every hook between ours,
        another library's or the user's (a logging or noise hook, FSDP2's gathering), run again
        as the forward ran them. Hooks, never a replaced `forward`: other libraries set a
        module's forward on the instance or its class before or after us (transformers'
        `kernelize`, at every `train()` / `eval()` where kernels are on; class patches), and
        removing the hooks takes back exactly what was ours. Regions never nest, so a module
        that a region's replay runs again ran plainly in the forward; it does so again, whatever
        the plan is by then (in 1F1B the next micro-batch is planned before this one's backward)."""
        opened: list[ExitStack | None] = []  # per call of the module, innermost last

        def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
            opened.append(None)  # first: `leave` runs also when opening raises
            opened[-1] = self._open(module, layer, unit, module, args, kwargs)

        def leave(*_) -> None:
            region = opened.pop()
            if region is not None:
                region.close()

        handles = (module.register_forward_pre_hook(enter, with_kwargs=True),
                   module.register_forward_hook(leave, always_call=True))
        self._enclosing.append((module, *handles))
        for handle in handles:
            stack.callback(handle.remove)

    def _run(self, module: nn.Module, layer: int, unit: tuple[str, ...], forward, args: tuple, kwargs: dict):
        """`forward(*args, **kwargs)`, as a recompute region if the plan makes `unit` one now."""
        region = self._open(module, layer, unit, forward, args, kwargs)
        if region is None:
            return forward(*args, **kwargs)
        with region:
            return forward(*args, **kwargs)

    def _open(self, module: nn.Module, layer: int, unit: tuple[str, ...], forward, args: tuple, kwargs: dict) -> ExitStack | None:
        """The recompute region of `unit`, entered, if the plan makes it one now (None: run
        plainly): the caller runs `forward(*args, **kwargs)` inside, then closes it."""
        dropped_ops = self._regions.get((layer, unit))
        if dropped_ops is None or not self._forwarding or not torch.is_grad_enabled() or is_inside_backward():
            return None

        def dropped() -> bool:
            op = self.tracker.current
            return op is not None and op.layer == layer and op.name in self._regions.get((layer, unit), ())

        saves = nullcontext if dropped_ops == set(unit) else SpanSaves(dropped)
        stack = ExitStack()
        current, self.tracker.current = self.tracker.current, OpId(layer, unit[0])  # the region's inputs are its first op's
        try:
            frame = stack.enter_context(region(module, forward, self.adapter.config, args, kwargs, saves, self._holding()))
        finally:
            self.tracker.current = current
        frames = self.micro_batches.of(self.micro_batches.running).regions  # weakly: a frame dies with its graph
        frames[layer] = [*(ref for ref in frames.get(layer, ()) if ref() is not None), weakref.ref(frame)]
        return stack

    def recover(self, micro_batch: int | None, layer: int) -> None:
        """The recovery of `layer` for `micro_batch`'s backward, run ahead of it: its host copies
        start coming back and its recompute regions replay now, so that backward replays nothing.
        The fused dual-batch executor (paper §V-B) interleaves it with other micro-batches' work at
        a steady 1F1B scheduling point. Nothing happens where there is nothing to recover (no such
        micro-batch or layer, or its backward has run)."""
        self.hooks.prefetch(micro_batch, layer)
        current = self.tracker.current  # a replay runs the op scopes: an interleaved forward goes on in its own op
        try:
            state = self.micro_batches.get(micro_batch)
            for ref in reversed(state.regions.pop(layer, []) if state is not None else []):  # in backward order
                frame = ref()
                if frame is not None:
                    frame.recompute_now()
        finally:
            self.tracker.current = current

    def release(self, micro_batch: int | None) -> None:
        """`micro_batch`'s backward has run: what `recover` would use for it (its regions' frames,
        its host copies' chain, all dead now) goes with its state (`MicroBatches.release`)."""
        self.micro_batches.release(micro_batch)

    def _holding(self):
        """While the plan's hooks are in force, a region's inputs stay on the device as they are,
        as the cost model holds them, whatever op runs when the region begins and saves them (a
        MoE block begins in mlp_norm, a layer in the previous layer's last op, a span in its first
        op, any of which the plan may offload)."""
        if top_hooks()[0] != self.hooks.pack:
            return nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.hooks.keep(t, _storage(t)), self.hooks.unpack)

    def _runner(self, layer: int):
        """The experts' runner: the routed experts (`EXPERT_OPS`) or one expert op, as a region
        if the plan makes it one (under expert parallelism, the computation between dispatch and
        combine; or, the collective unit, dispatch and combine with it), with PEFT's LoRA on the
        expert weights in force when it replays."""
        wrapped = self.adapter.layers[layer].wrapped

        def run(unit, op, experts, *args, **kwargs):
            if self._forwarding:
                self._dispatched.add(experts)

            def forward(*a, **kw):
                with adapted_weights(wrapped):
                    return op(experts, *a, **kw)

            return self._run(experts, layer, unit, forward, args, kwargs)

        return run

    @contextmanager
    def forward(self, refresh: bool = True) -> Iterator[Ledger]:
        """The plan for the training forward passes inside the block: the "bagualu" experts, no KV
        cache (recomputation would update it again), the op scopes and the saved-tensor hooks.
        `refresh`: first have the Ledger walk the model again if it changed (a caller that checks
        once per iteration passes False for the other micro-batches).
        Outside it the model runs as it would without the plugin (evaluation, `generate` with its
        KV cache and transformers' own choice of experts kernel for decoding): the hooks `install`
        put on its modules return at once there. A recompute replaying after the block sees no op
        scope, as none is needed: a span replays its forward's decisions (`SpanSaves`), saves go
        to the replay, and nested regions run plainly (`is_inside_backward`). One replaying inside
        another micro-batch's block (`recover`, the dual-batch executor) runs the scopes, and its
        caller puts the forward's op back."""
        if self._forwarding:
            raise ValueError("PlanRuntime.forward(): a forward is running already (the block does not nest)")
        if self._stack is None:
            raise ValueError("PlanRuntime.forward(): call install() first (it puts the op scopes on the model)")
        if refresh:
            self.ledger.refresh_if_changed()  # the model may have moved since (`.cuda()` after the runtime was built)
        self.patches.check(self.ledger.modules)
        self._enclose()
        self.hooks.new_forward()  # also where no model forward runs (a pipeline stage runs its modules)
        # a plan that keeps or recomputes every op only has its saves counted: the Ledger's own
        # hooks, which skip the plan's per-save lookups (every micro-batch's path at ample memory)
        saves = self.hooks if self.plan.stores else self.ledger
        with ExitStack() as stack:
            stack.enter_context(self._flag("stored" if saves is self.hooks else "counted"))
            stack.enter_context(bagualu_experts(self.adapter.config))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(saves.pack, saves.unpack))
            self._returned.clear()
            self._dispatched.clear()
            yield self.ledger
            if self._returned - self._dispatched:  # experts whose forward in force never ran the plugin's ops
                self.patches.undispatched([m for m in self._returned if m not in self._dispatched])

    @contextmanager
    def _flag(self, saves: str) -> Iterator[None]:
        """Inside: a training forward with no KV cache (recomputation would update it again), its
        op scopes on; they start from none, and end with none. `saves`: "stored" under the plan's
        hooks, "counted" under the Ledger's."""
        config = self.adapter.config
        cache = config.use_cache
        if cache is not False:  # a config's validated write costs ~10 us: none where nothing changes
            config.use_cache = False
        self._forwarding, self.tracker.active, self.tracker.current = saves, True, None
        try:
            yield
        finally:
            if cache is not False:
                config.use_cache = cache
            self._forwarding, self.tracker.active, self.tracker.current = None, False, None

    def remove(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


def _ours(hook) -> bool:
    return getattr(getattr(hook, "__func__", hook), "__module__", "").startswith("bagualu_plugin.")


def _around(hooks, own: int, last: bool) -> None:
    """Move the other libraries' hooks that come before `own` (after it, when `last`) of the
    ordered `hooks` to its other side, keeping every other order: a region's pre-hook is then
    outside all but the plugin's own hooks, its hook too."""
    keys = list(reversed(hooks) if last else hooks)
    outside = keys[: keys.index(own)]
    foreign = [key for key in outside if not _ours(hooks[key])]
    if not foreign:
        return
    rest = keys[keys.index(own) + 1:]
    order = [key for key in outside if key not in foreign] + [own] + foreign + rest
    for key in order:  # rebuilt in that order from the far side
        hooks.move_to_end(key, last=not last)


@contextmanager
def apply_plan(
    model: nn.Module,
    plan: Mapping,
    *,
    ledger: Ledger | None = None,
    options: MitigationOptions = MitigationOptions(),
) -> Iterator[Ledger]:
    """Install `plan` for the forward passes inside the block and yield the Ledger that counts
    what they save (docs/architecture.md). Backward may run inside or after the block. On exit
    every hook, wrapper and setting is removed, also when the body raises."""
    runtime = PlanRuntime(model, ledger=ledger, options=options)
    runtime.set_plan(plan)  # validated before anything is installed
    runtime.agree_on_collectives()
    runtime.install()
    try:
        with runtime.forward() as counted:
            yield counted
    finally:
        runtime.remove()

