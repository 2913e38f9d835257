"""Gate time: the moment after an MoE router has chosen its experts and before the experts run.

`GateMonitor` records there, per MoE layer, how many (token, expert) pairs each expert received
and how many landed on this rank's experts (S, the quantity the provisioner plans with;
docs/architecture.md), and calls `on_gate` so a provisioner can escalate a layer's mitigation once the real
routing is known (deferred planning, paper section V-A).

`RoutingSkew` rewrites part of the routing onto one rank's experts, deterministically, to
reproduce the routing spikes of expert parallelism (paper section II-B) in tests, benchmarks and
demos.

Every family's router returns `(router_logits (T, E), top_k_weights (T, k), top_k_index (T, k))`;
a forward hook on it runs after routing and before the experts in all supported families. Under
expert parallelism (`bgl.expert_parallel`) a rank learns its local pairs only when the counts
have been exchanged: there the experts' dispatch calls the monitor (`GATE_ATTR`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial
from numbers import Real

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .adapter import GATE_ATTR, Adapter, Layer, is_inside_backward
from .experts import local_expert_range, sharded

OnGate = Callable[[int, torch.Tensor | None, torch.Tensor | int], None]


def _adapter(model_or_adapter) -> Adapter:
    return model_or_adapter if isinstance(model_or_adapter, Adapter) else Adapter(model_or_adapter)


def _router_output(layer: Layer, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not (isinstance(output, tuple) and len(output) == 3):
        raise TypeError(
            f"layer {layer.index}: router {type(layer.router).__name__} returned {type(output).__name__}, expected "
            "(router_logits, top_k_weights, top_k_index)"
        )
    return output


def tokens_per_expert(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64 count of routed pairs per expert; sentinel ids (< 0 or >= E) are not counted.
    On a GPU a scatter-add, not `torch.bincount`, so it never synchronises with the host; on the
    CPU, where nothing waits, one `bincount` (a third of the kernel launches: this runs at every gate)."""
    ids = top_k_index.reshape(-1)
    if ids.is_cpu:  # sentinels to bins 0 and E + 1, dropped
        return torch.bincount(ids.clamp(-1, num_experts) + 1, minlength=num_experts + 2)[1:-1]
    ids = ids.long()
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # sentinels -> bin E, dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))[:num_experts]


class _RouterHooks:
    """The subclass's `_hook(layer, module, args, output)` as a forward hook on the router of
    each of `layers`, installed and removed together (also as a context manager)."""

    prepend = False  # run ahead of the routers' other forward hooks

    def __init__(self, adapter: Adapter, layers: list[Layer]):
        self.adapter, self.layers = adapter, layers
        self._handles: list[RemovableHandle] = []

    def install(self):
        if self._handles:
            raise RuntimeError(f"{type(self).__name__} is installed already")
        for layer in self.layers:
            self._handles.append(layer.router.register_forward_hook(partial(self._hook, layer), prepend=self.prepend))
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()


class GateMonitor(_RouterHooks):
    """Per-MoE-layer routed counts, recorded at gate time as device tensors.

    on_gate(layer_index, tokens_per_expert, local_pairs) is called in forward only: in one
    process with the (E,) counts of the layer's routing, all of them local, and their sum (0-dim);
    under expert parallelism with the (E/ep,) pairs each local expert received from all ranks, and
    their sum. `per_expert=False` (the Provisioner's, which decides on the local pairs alone): in
    one process no counts (None) and the pairs as an int, the router's top-k slots, which every
    expert here receives: no kernel and no host synchronisation at the gate (transformers' own
    expert parallelism, which marks other ranks' pairs with sentinels, still counts them).
    When a checkpoint re-runs a layer during backward the routing is known already, so the hook
    neither calls on_gate nor overwrites the records (decisions are never taken twice). While
    `active` is False the installed hooks return at once (a Provisioner installs the monitor once
    and turns it on for its training forwards only)."""

    active = True

    def __init__(self, adapter, on_gate: OnGate | None = None, *, per_expert: bool = True):
        if on_gate is not None and not callable(on_gate):
            raise ValueError(f"on_gate must be callable or None, got {on_gate!r}")
        adapter = _adapter(adapter)
        super().__init__(adapter, [layer for layer in adapter.layers if layer.moe])
        self.on_gate = on_gate
        self.per_expert = per_expert
        self._counts: dict[int, torch.Tensor | None] = {}
        self._local: dict[int, torch.Tensor | int] = {}

    def install(self):
        super().install()
        for layer in self.layers:
            if layer.expert_parallel:
                setattr(layer.experts, GATE_ATTR, partial(self._record, layer))
        return self

    def remove(self) -> None:
        for layer in self.layers:
            if getattr(layer.experts, GATE_ATTR, None) is not None:
                delattr(layer.experts, GATE_ATTR)
        super().remove()

    def _hook(self, layer: Layer, module: nn.Module, args, output) -> None:
        if not self.active or is_inside_backward() or layer.expert_parallel:
            return
        index = _router_output(layer, output)[2]
        if not self.per_expert and not sharded(layer.experts):
            self._record(layer, None, index.numel())
            return
        counts = tokens_per_expert(index, self.adapter.num_experts)
        self._record(layer, counts, counts.sum())

    def _record(self, layer: Layer, counts: torch.Tensor | None, local_pairs: torch.Tensor | int) -> None:
        if not self.active:
            return
        self._counts[layer.index] = counts
        self._local[layer.index] = local_pairs
        if self.on_gate is not None:
            self.on_gate(layer.index, counts, local_pairs)

    def counts(self, layer: int) -> torch.Tensor:
        """What MoE layer `layer`'s experts received in the last forward (a device tensor): (E,) per
    expert, or (E/ep,) per local expert under expert parallelism."""
        if layer not in self._counts:
            recorded = sorted(self._counts) or "none yet"
            raise KeyError(f"no routing recorded for layer {layer}; recorded layers: {recorded}")
        if self._counts[layer] is None:
            raise KeyError(f"layer {layer}: this monitor keeps no per-expert counts (per_expert=False)")
        return self._counts[layer]

    def local_pairs(self) -> dict[int, int]:
        """{layer: routed pairs on this rank's experts} for the recorded layers (one host sync)."""
        tensors = {i: t for i, t in self._local.items() if isinstance(t, torch.Tensor)}
        if len({t.device for t in tensors.values()}) == 1:
            synced = dict(zip(tensors, torch.stack(list(tensors.values())).tolist()))
        else:  # layers on several devices (e.g. pipeline stages in one process): one sync each
            synced = {i: int(t) for i, t in tensors.items()}
        return {i: synced.get(i, n) for i, n in self._local.items()}

    def reset(self) -> None:
        self._counts.clear()
        self._local.clear()


# Knuth's multiplicative hash: (p * A) mod 2**32 is a golden-ratio Weyl sequence, so consecutive
# pairs spread evenly over [0, 2**32) and a threshold selects close to `fraction` of any run.
# Each layer shifts the sequence by layer * frac(sqrt(2)), so layers select different pairs.
_HASH_A = 2654435761
_HASH_LAYER = 1779033703
_HASH_RANGE = 1 << 32


class RoutingSkew(_RouterHooks):
    """Rewrite `fraction` of the (token, slot) pairs of each router output onto the experts of rank
    `ep_rank` of an expert-parallel group of `ep_size` (every rank installs the same skew, so that
    rank receives 1 + fraction (ep - 1) times its balanced share).

    Which pairs: a pure function of the flat pair position p = token * k + slot and the layer
    (`mask`), with no RNG state, so a checkpoint's recompute routes exactly as the forward did.
    Selected pairs already on a local expert are kept; the others move to the local experts the
    token does not use yet, in a rotation that starts at (token + layer): its j-th moved pair takes
    the j-th free one. Only when the rank hosts fewer experts than the token needs (E/ep < k) can
    one token list the same expert twice. top_k_weights are kept, so gradients still
    reach the router. Registered before other router hooks, so `GateMonitor` sees the new routing.
    """

    prepend = True

    def __init__(self, adapter, fraction: float, ep_size: int, ep_rank: int, layers: Iterable[int] | None = None):
        adapter = _adapter(adapter)
        if isinstance(fraction, bool) or not isinstance(fraction, Real) or not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
        self.fraction = float(fraction)
        moe = {layer.index: layer for layer in adapter.layers if layer.moe}
        if layers is None:
            chosen = list(moe)
        else:
            if isinstance(layers, (int, str)):
                raise ValueError(f"layers must be an iterable of MoE layer indices or None, got {layers!r}")
            chosen = list(layers)
            bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or i not in moe]
            if bad:
                raise ValueError(f"layers {bad} are not MoE layers; MoE layers: {sorted(moe)}")
        super().__init__(adapter, [moe[i] for i in chosen])
        self.local = {layer.index: local_expert_range(adapter.num_experts, ep_size, ep_rank) for layer in self.layers}
        self.ep_size = ep_size

    def _hook(self, layer: Layer, module: nn.Module, args, output):
        router_logits, top_k_weights, top_k_index = _router_output(layer, output)
        return router_logits, top_k_weights, self.rewrite(top_k_index, layer.index)

    def mask(self, num_tokens: int, top_k: int, layer: int, device=None) -> torch.Tensor:
        """(T, k) bool: the pairs of `layer` this skew selects (a function of position only)."""
        p = torch.arange(num_tokens * top_k, dtype=torch.int64, device=device)
        h = (p * _HASH_A + layer * _HASH_LAYER) % _HASH_RANGE
        return (h < math.floor(self.fraction * _HASH_RANGE)).view(num_tokens, top_k)

    def rewrite(self, top_k_index: torch.Tensor, layer: int) -> torch.Tensor:
        """A new (T, k) index with the selected remote pairs moved onto local experts.

        Vectorised over tokens (a few tensor ops per router call, whatever T and k): each token
        ranks its free local experts by the rotation, and its j-th moved pair takes the j-th."""
        local = self.local[layer]
        lo, n = local.start, len(local)
        num_tokens, top_k = top_k_index.shape
        device = top_k_index.device
        offset = top_k_index - lo  # position among the local experts, when in [0, n)
        is_local = (offset >= 0) & (offset < n)
        remote = (top_k_index >= 0) & (top_k_index < n * self.ep_size) & ~is_local
        move = self.mask(num_tokens, top_k, layer, device) & remote
        taken = torch.zeros(num_tokens, n + 1, dtype=torch.bool, device=device)  # column n: not local
        taken.scatter_(1, torch.where(is_local, offset, n), True)
        token = torch.arange(num_tokens, device=device).unsqueeze(1)
        rotation = (torch.arange(n, device=device) - token - layer) % n  # 0 = where the token starts
        order = torch.argsort(rotation + n * taken[:, :n], dim=1)  # free experts first, by rotation
        nth = (torch.cumsum(move, dim=1) - 1).clamp(min=0)
        free = (~taken[:, :n]).sum(dim=1, keepdim=True)
        slot = torch.arange(top_k, device=device)
        fallback = (token + layer + slot) % n  # more moved pairs than free local experts (n < k)
        choice = torch.where(nth < free, torch.gather(order, 1, nth.clamp(max=n - 1)), fallback)
        return torch.where(move, lo + choice.to(top_k_index.dtype), top_k_index)
