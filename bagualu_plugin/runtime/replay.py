"""Our checkpoint of a recompute region (paper §IV-B), able to replay ahead of backward (§V-B).

The region's forward runs once; its tensor inputs are saved for backward through the hooks in force
outside it (the Ledger counts them), every save inside it becomes a small handle. The region
replays once, at the first unpack in backward or earlier through `Frame.recompute_now()`; backward
then takes each saved tensor from its handle. Why not torch's non-reentrant checkpoint: it replays
only at the first unpack in backward and keys what it recomputed by the graph task running that
backward, so a replay run before backward is thrown away and run again.

The inputs are saved as autograd saves an op's input: a SavedVariable where torch can make one from
Python (2.13 on), else `HookedInput`, the same through the hooks in force.
A replay runs as the forward ran: the RNG state (CPU, and each CUDA device of its inputs) and the
autocast state of the forward, grad enabled. It stops at its last save the graph still needs (as
torch's early stop does), and fails if it saved fewer tensors than the forward, or a different one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch

from ..adapters.adapter import replaying

_make_saved_tensor = getattr(torch._C._autograd, "_make_saved_tensor", None)  # torch >= 2.13


def same(x):
    return x


def top_hooks() -> tuple[Callable, Callable]:
    """The saved-tensor hooks in force now (a checkpoint's, the plan's); none: save as autograd does."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) or (same, same)


class ReplayError(RuntimeError):
    """A region's replay did not save what its forward saved, or a saved tensor was asked for twice."""


class _Done(Exception):
    """Raised by the replay's last save: the rest of the region need not run."""


class HookedInput:
    """A tensor saved as autograd saves an op's input, where torch (before 2.13) cannot make a
    SavedVariable from Python: packed by the saved-tensor hooks in force (the Ledger counts it, an
    offload moves it), refused at unpack if changed in place since (where the unpack hands back
    the tensor itself, as autograd checks), and handed back asking for gradients as it did (an
    unpack hook's copy does not: the replay must save what the forward saved)."""

    __slots__ = ("_packed", "_unpack", "_version", "_requires_grad", "_original")

    def __init__(self, tensor: torch.Tensor):
        pack, self._unpack = top_hooks()
        self._packed = pack(tensor)
        self._version, self._requires_grad = tensor._version, tensor.requires_grad
        self._original = weakref.ref(tensor)

    def unpack(self) -> torch.Tensor:
        tensor = self._unpack(self._packed)
        if tensor is self._original() and tensor._version != self._version:
            raise ReplayError(
                f"an input of a recompute region was modified in place after the region's forward (version "
                f"{self._version}, now {tensor._version}): its replay would compute from other values than the forward"
            )
        if tensor.requires_grad != self._requires_grad:
            tensor = tensor.detach().requires_grad_(self._requires_grad)
        return tensor


def _save_input(tensor: torch.Tensor):
    return _make_saved_tensor(tensor, is_output=False) if _make_saved_tensor is not None else HookedInput(tensor)


class _Saved:
    """A save of the region's forward, as the graph holds it: the tensor's shape and dtype, and the
    tensor itself once the region has replayed, until backward takes it."""

    __slots__ = ("meta", "tensor", "__weakref__")

    def __init__(self, meta: tuple):
        self.meta, self.tensor = meta, None


class Frame:
    """One run of a region. The graph holds its handles, and the frame through their unpack hook;
    the frame holds the handles weakly, so each one, and the recomputed tensor in it, goes when
    backward has used it, and the frame with everything it holds dies with the graph. Once
    replayed it lets go of its inputs: backward needs only what the replay saved."""

    def __init__(self, run: Callable, inputs: tuple[torch.Tensor, ...]):
        self.run = run
        self.inputs = [_save_input(t) for t in inputs]
        self.saves: list[weakref.ref] = []
        self.replayed = False
        self._cpu_rng = torch.get_rng_state()
        devices = {t.device for t in inputs if t.is_cuda} if torch.cuda.is_initialized() else ()
        self._cuda_rng = {d: torch.cuda.get_rng_state(d) for d in devices}
        kinds = [k for k in dict.fromkeys(["cpu", *(t.device.type for t in inputs)]) if torch.amp.is_autocast_available(k)]
        self._autocast = [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds]
        self._autocast_cache = torch.is_autocast_cache_enabled()

    def pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved((tensor.shape, tensor.dtype))
        self.saves.append(weakref.ref(saved))
        return saved

    def unpack(self, saved: _Saved) -> torch.Tensor:
        self.recompute_now()
        tensor, saved.tensor = saved.tensor, None
        if tensor is None:
            raise ReplayError(
                "a recompute region's saved tensor was unpacked a second time (a second backward through the same "
                "graph, retain_graph=True?): a region replays once and hands each saved tensor out once"
            )
        return tensor

    def recompute_now(self) -> None:
        """Replay the region unless it has replayed, keeping what it saves for backward: at the first
        unpack in backward, or ahead of backward, grad enabled there too (paper §V-B)."""
        if self.replayed:
            return
        inputs = [saved.unpack() for saved in self.inputs]
        count = 0

        def take(tensor: torch.Tensor) -> torch.Tensor:
            """Keep the replay's save for backward; the replay's own graph, discarded, gets a detached alias
            (an output kept as it is would hold its own node through this hook: a cycle the collector cannot see)."""
            nonlocal count
            tensor = tensor.detach()
            saved, count = self.saves[count](), count + 1
            if saved is not None:  # else backward has used it already
                meta = (tensor.shape, tensor.dtype)
                if meta != saved.meta:
                    raise ReplayError(
                        f"a recompute region's save {count - 1} was a {saved.meta[1]} of shape {tuple(saved.meta[0])} in its "
                        f"forward and is a {meta[1]} of shape {tuple(meta[0])} in its replay: the region is not deterministic"
                    )
                saved.tensor = tensor
            if count == len(self.saves):
                raise _Done
            return tensor

        if self.saves:
            with self._as_in_forward(), torch.autograd.graph.saved_tensors_hooks(take, _same):
                try:
                    self.run(*inputs)
                except _Done:
                    pass
        if count != len(self.saves):
            raise ReplayError(
                f"a recompute region saved {len(self.saves)} tensors for backward in its forward but {count} in its "
                "replay: the region is not deterministic, and its gradients would be wrong"
            )
        self.replayed, self.inputs = True, None

    @contextmanager
    def _as_in_forward(self) -> Iterator[None]:
        """The forward's RNG and autocast state (the caller's RNG state comes back after), grad enabled."""
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=list(self._cuda_rng), device_type="cuda"))
            torch.set_rng_state(self._cpu_rng)
            for device, state in self._cuda_rng.items():
                torch.cuda.set_rng_state(state, device)
            for kind, enabled, dtype in self._autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=self._autocast_cache))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(replaying())
            yield


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextmanager
def recording(run: Callable, inputs: tuple[torch.Tensor, ...]) -> Iterator[Frame]:
    """Inside, a recompute region's forward runs (the caller runs it, as `run(*inputs)` would, or
    torch runs a module between the hooks that enter and leave the block): every save becomes a
    handle of the yielded frame, which replays `run(*inputs)` for backward."""
    frame = Frame(run, inputs)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        yield frame
