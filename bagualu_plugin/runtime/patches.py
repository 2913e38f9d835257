"""What other libraries changed on the model the plugin installed on, checked as each training
forward begins (and the experts' dispatch where it ends): supported, or refused by name.

Supported: any forward set on a module's instance or class where the plugin runs the module as it
is (norms, attention, MLPs: transformers' `kernelize`, Liger-Kernel's norms, a user's class patch),
whose recompute regions replay whatever forward is in force and whose bytes the Ledger measures.
Refused, naming the module, the patcher and what to do, because the plugin would plan mitigations
that never run:

- routed experts whose forward is not transformers' experts dispatch (a `kernelize` mapping for the
  experts, Liger-Kernel's `LigerExperts`, a class patch): the plugin's expert ops, the units its
  plans recompute, never run. Another class's forward set on them is refused before the forward;
  a function (a wrapper, a class patch) where the forward shows it: the experts' forward returned
  without running the plugin's expert ops;
- a causal LM forward not the model class's own (Liger-Kernel's fused linear cross-entropy): its LM
  head and loss run outside the modules the plugin plans;
- a module compiled on its own (`module.compile()`, `torch.compile(module)`), whose graph takes in
  the plugin's hooks and replays nothing;
- a module the plugin hooked, replaced after it installed: its hooks stay on the old one.
"""

from __future__ import annotations

from itertools import repeat

from torch import nn
from transformers.integrations.moe import use_experts_implementation

from ..adapters import Adapter


class _Probe(nn.Module):
    def forward(self):
        return None


# the code of the forward transformers' decorator gives an experts class: it dispatches by the config
_DISPATCH = use_experts_implementation(_Probe).forward.__code__


def forward_in_force(module: nn.Module) -> tuple[object, type | None]:
    """The function `module(...)` runs, and the class it is set on (None: the instance)."""
    if "forward" in vars(module):
        return module.forward, None
    owner = next(c for c in type(module).__mro__ if "forward" in vars(c))
    return vars(owner)["forward"], owner


def _chain(function: object) -> list:
    """`function` and every function it wraps (`functools.wraps`: transformers' decorators,
    accelerate's autocast and device-map hooks), outermost first."""
    chain = []
    while function is not None and len(chain) < 64:
        function = getattr(function, "__func__", function)
        chain.append(function)
        function = getattr(function, "__wrapped__", None)
    return chain


def _name(function: object) -> str:
    function = getattr(function, "__func__", function)
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def _where(owner: type | None) -> str:
    return "set on the instance" if owner is None else f"on the class {owner.__name__}"


def _dispatches(function: object) -> bool:
    return any(getattr(f, "__code__", None) is _DISPATCH for f in _chain(function))


def _foreign_method(experts: nn.Module) -> bool:
    """Whether the experts' forward in force is another class's method (`kernelize`'s layer,
    Liger-Kernel's `LigerExperts`), which replaces transformers' dispatch rather than calling it.
    A plain function (a wrapper, a class patch) may call the dispatch: the forward shows it."""
    function, _ = forward_in_force(experts)
    if _dispatches(function):
        return False
    qualname = getattr(getattr(function, "__func__", function), "__qualname__", "")
    owner = qualname.rsplit(".", 1)[0] if "." in qualname else ""
    return bool(owner) and "<locals>" not in owner and owner not in {c.__qualname__ for c in type(experts).__mro__}


def _compiled(state: dict) -> bool:
    """`module.compile()` (torch keeps the compiled call on the instance) or `torch.compile(module)`
    (a wrapper module holding the original as `_orig_mod`), read off the module's `vars()`: a missing
    attribute would cost `nn.Module.__getattr__` an exception, at every module of every forward."""
    return state.get("_compiled_call_impl") is not None or "_orig_mod" in state.get("_modules", ())


def _forwards(module: nn.Module) -> tuple:
    """What decides `module`'s forward in force: the instance's own and its class's (a key that
    changes when either is set)."""
    return vars(module).get("forward"), type(module).forward


def _defined(model: nn.Module) -> type | None:
    """The transformers class whose forward the model's is."""
    return next((c for c in type(model).__mro__ if "forward" in vars(c) and c.__module__.startswith("transformers.")), None)


def _replaced(model: nn.Module) -> bool:
    """Whether the causal LM's forward in force is not its transformers class's own (through the
    decorators and wrappers that keep it: accelerate's autocast on the instance)."""
    defined = _defined(model)
    function, _ = forward_in_force(model)
    return defined is not None and getattr(_chain(function)[-1], "__module__", None) != defined.__module__


class Patches:
    """The checks of one installed runtime: `hooked` are the modules the plugin put hooks or
    runners on, by their path in the model when it installed."""

    def __init__(self, adapter: Adapter, hooked: list[nn.Module]):
        self.adapter = adapter
        names = {module: name for name, module in adapter.model.named_modules()}
        self.hooked = {module: names.get(module, type(module).__name__) for module in hooked}
        self.names = names
        self._tree: frozenset | None = None
        self._states: list[dict] = []  # the `vars()` of the modules of `_tree`: what `module.compile()` writes to
        self._seen: dict[tuple, bool] = {}  # (module class, `_forwards`) -> whether it is refused: checked once

    def check(self, tree: frozenset[nn.Module]) -> None:
        """Raise ValueError for the first refused change (see the module's docstring); `tree`: the
        model's modules now (the Ledger's walk: a new set only when they changed)."""
        a = self.adapter
        if tree is not self._tree:
            gone = [name for module, name in self.hooked.items() if module not in tree]
            wrapped = [name for name, module in a.model.named_modules() if _compiled(vars(module))]  # torch.compile(module)
            if wrapped:
                self._refuse_compiled(wrapped)
            if gone:
                raise ValueError(
                    f"bagualu: {', '.join(gone[:4])}{' ...' if len(gone) > 4 else ''} replaced after the plugin installed: "
                    "its hooks and runners stay on the module it replaced, so its plans would not run on the new one. "
                    "Replace modules before bgl.apply (or the Trainer's train()), or remove the plugin (prov.remove()) "
                    "and apply it again"
                )
            self._tree, self._states = tree, [vars(m) for m in tree]
        # compile() registers no module: looked for at every forward (C-level, ~30 ns a module)
        if any(map(dict.get, self._states, repeat("_compiled_call_impl"))):
            self._refuse_compiled([name for name, module in a.model.named_modules() if _compiled(vars(module))])
        for part in a.layers:  # another class's forward on the experts (kernelize's, Liger's) never dispatches
            if part.experts is not None and self._once(part.experts, _foreign_method):
                self.undispatched([part.experts])
        if self._once(a.model, _replaced):
            function, owner = forward_in_force(a.model)
            defined = _defined(a.model)
            raise ValueError(
                f"bagualu: the model's forward is {_name(function)} ({_where(owner)}), not {defined.__name__}'s own: its LM "
                "head and loss would run outside the modules the plugin plans (a fused linear cross-entropy). Leave the "
                "model's forward unpatched (Liger-Kernel: apply_liger_kernel_to_*(fused_linear_cross_entropy=False); the "
                "plugin has its own chunked loss, strategies.loss_chunk_tokens), or train without the plugin"
            )

    @staticmethod
    def _refuse_compiled(names: list[str]) -> None:
        raise ValueError(
            f"bagualu: {', '.join(names[:4])} compiled on its own (module.compile() or torch.compile(module)): the "
            "compiled graph takes in the plugin's hooks and saved-tensor hooks, so its recompute regions would replay "
            "nothing. Train uncompiled with the plugin, or compile without the plugin"
        )

    def _once(self, module: nn.Module, refused) -> bool:
        """`refused(module)`, found once per class of module and forward in force."""
        key = (type(module), *_forwards(module))
        verdict = self._seen.get(key)
        if verdict is None:
            verdict = self._seen[key] = refused(module)
        return verdict

    def undispatched(self, experts: list[nn.Module]) -> None:
        """Raise ValueError for routed experts whose forward does not run transformers' experts
        dispatch (seen before the forward, or in it: their forward returned, the plugin's expert ops not run)."""
        module = experts[0]
        function, owner = forward_in_force(module)
        names = ", ".join(self.names.get(m, type(m).__name__) for m in experts[:4]) + (" ..." if len(experts) > 4 else "")
        raise ValueError(
            f"bagualu: {names} runs {_name(function)} ({_where(owner)}), not transformers' experts dispatch: the "
            "plugin's expert ops (expert_fc1, expert_act, expert_fc2) would never run and a plan recomputing or "
            "offloading them would do nothing. Leave the experts unpatched (Liger-Kernel: "
            "apply_liger_kernel_to_*(swiglu=False); kernelize: no mapping for the experts), or train without the plugin"
        )
