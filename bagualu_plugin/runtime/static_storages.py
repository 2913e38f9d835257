"""Static storages: what is not an activation. The storages of a model's parameters and buffers
(and views of them) are static memory, which the Ledger never counts, whatever wraps, moves or
replaces them after it was made (DDP, FSDP2, ZeRO-3, `.cuda()`).

Separate from the count (ledger.py), which asks `is_static` at every save and knows nothing of how
the answer is kept right: torch's global registration hooks, the slots re-read without a walk, the
sharding engines' gathers. It also holds `_storage`, the key of a tensor's storage, which the count
reads too: this module is below the Ledger.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from operator import getitem
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules import module as _module

StorageKey = tuple[torch.device, int]


def model_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The device a model computes on: that of its first parameter off the CPU (a CUDA tensor's
    device carries its index), else the CPU. Meta tensors (another pipeline stage's) compute nowhere."""
    for t in tensors:
        if t.device.type not in ("cpu", "meta"):
            return t.device
    return torch.device("cpu")


_storage_of, _pointer, _device_of = torch.Tensor.untyped_storage, torch.UntypedStorage.data_ptr, torch.Tensor.get_device


def _storage(tensor: torch.Tensor) -> tuple[StorageKey, int] | None:
    """(key, nbytes) of the storage behind ``tensor``; None when it holds no real memory.

    Sparse tensors and wrapper subclasses have no storage, meta and fake tensors a storage without
    memory (its address is 0), empty tensors one of 0 bytes: none of them can occupy activation
    memory here. (This runs for every saved tensor: no device type string is made.)
    """
    try:
        storage = _storage_of(tensor)
        pointer, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None
    if not pointer or not nbytes:
        return None
    return (storage.device, pointer), nbytes


def _key(tensor: torch.Tensor | None) -> StorageKey | None:
    found = None if tensor is None else _storage(tensor)
    return None if found is None else found[0]


class _Slots(NamedTuple):
    """Where the exclusions came from, to be read back without walking the model: the
    (owner dict, name) of every parameter and buffer with a storage, with that storage's pointer
    and device index (`Tensor.get_device`, -1 on the CPU: an int, no device object made per
    slot; compared by C-level maps), and the slots with none (meta, empty, sharded DTensor or
    None: they exclude nothing, as long as they still have none)."""

    owners: tuple[dict, ...]
    names: tuple[object, ...]
    pointers: tuple[int, ...]
    devices: tuple[int, ...]
    empty: tuple[tuple[dict, object], ...]

    def unchanged(self) -> bool:
        try:
            tensors = tuple(map(getitem, self.owners, self.names))
            if tuple(map(_device_of, tensors)) != self.devices or tuple(map(_pointer, map(_storage_of, tensors))) != self.pointers:
                return False
        except Exception:  # a slot gone, now None or without a storage: let the walk see what it is
            return False
        return all(_key(owner.get(name)) is None for owner, name in self.empty)


_static_storages: weakref.WeakSet[StaticStorages] = weakref.WeakSet()


def _registered(module: nn.Module, _name: str, _value: object) -> None:
    """torch's global hook on every parameter, buffer and submodule registered (`__setattr__`,
    `register_*`): the static storages whose model holds `module` walk it again."""
    for static in tuple(_static_storages):
        static.notice(module)


for _register in (_module.register_module_parameter_registration_hook, _module.register_module_buffer_registration_hook,
                  _module.register_module_module_registration_hook):
    _register(_registered)


class StaticStorages:
    """The storages of ``model``'s parameters and buffers and of the ``exclude`` tensors, kept right
    as they change (`refresh`, `changed`), and the compute device they give.

    ``device``: the compute device (saved CPU tensors are host memory under a CUDA one, see
    ``host_apart``); by default the device of the excluded parameters, looked up again by `refresh`
    (a model moved with `.cuda()` after these were made).
    """

    def __init__(self, *, exclude: Iterable[torch.Tensor] = (), model: nn.Module | None = None,
                 device: torch.device | str | None = None):
        self._exclude = dict(enumerate(exclude))  # slots, as a module's parameters are
        self._model = model  # its parameters and buffers are looked up again at every refresh
        self._gathered: dict[nn.Module, frozenset[StorageKey]] = {}  # FSDP2 modules' unsharded parameters
        self._watched: set[nn.Module] = set()
        self._device = None if device is None else torch.device(device)
        self._tree: frozenset[nn.Module] = frozenset()  # the model's modules at the last walk
        self._stale = True
        _static_storages.add(self)
        self.refresh()

    @property
    def modules(self) -> frozenset[nn.Module]:
        """The model's modules at the last walk (`refresh`): a new set only when they changed."""
        return self._tree

    def refresh(self) -> None:
        """Walk the model again: its parameters get new storages (and maybe a device) when it moves
        after these were made (`.cuda()`, `.to(dtype)`, DDP's `prepare`), or new objects
        (FSDP2's `fully_shard` replaces them with sharded ones). An FSDP2 module's whole parameters
        exist from its forward pre-hook, which gathers them, until its forward ends: they are
        excluded for that time (`_watch_engines`), as are ZeRO-3's. The Ledger calls it when
        `changed`."""
        self._stale = False  # first: a registration during the walk makes the next check walk again
        modules = () if self._model is None else tuple(self._model.modules())
        self._tree = frozenset(modules)
        slots = [(m._parameters, name) for m in modules for name in m._parameters]
        slots += [(m._buffers, name) for m in modules for name in m._buffers]
        slots += [(self._exclude, i) for i in range(len(self._exclude))]
        keyed, empty = [], []
        for owner, name in slots:
            if hasattr(owner[name], "ds_id"):  # ZeRO-3's: gathered into and freed from storages of its own,
                continue  # excluded only while gathered (`_watch_engines`); one kept now could be an activation's later
            key = _key(owner[name])
            if key is None:
                empty.append((owner, name))
            else:
                keyed.append((owner, name, key))
        owners, names, keys = zip(*keyed) if keyed else ((), (), ())
        devices = tuple(map(_device_of, map(getitem, owners, names)))
        self._slots = _Slots(owners, names, tuple(p for _, p in keys), devices, tuple(empty))
        self._excluded = frozenset(keys)
        static = [tensor for owner, name in slots if (tensor := owner[name]) is not None]
        self.device = self._device if self._device is not None else model_device(static)
        self.host_apart = self.device.type != "cpu"  # saved CPU tensors are host memory
        self._watch_engines(modules)

    def notice(self, module: nn.Module) -> None:
        """A parameter, buffer or submodule was registered on `module`: walk the model again at the
        next check if it holds `module`."""
        if module in self._tree:
            self._stale = True

    def _watch(self, module: nn.Module) -> None:
        """`_gathered[module]`: the storages of `module`'s parameters from its forward pre-hook to
        the end of its forward. The hooks hold these static storages weakly and remove themselves
        once they are gone (with their Ledger), so a model outlives the ledgers made for it without
        keeping them or their hooks."""
        ref, handles = weakref.ref(self), []

        def hook(gathered: bool):
            def run(m: nn.Module, *_) -> None:
                static = ref()
                if static is None:
                    for handle in handles:
                        handle.remove()
                else:
                    static._gather(m, gathered)

            return run

        # always called: a recompute that stops early (once it has what backward needs) leaves the
        # module's forward by an exception, and its storages, freed by the engine, must not stay excluded
        handles += [module.register_forward_pre_hook(hook(True)), module.register_forward_hook(hook(False), always_call=True)]

    def _gather(self, module: nn.Module, gathered: bool) -> None:
        if gathered:
            self._gathered[module] = frozenset(found[0] for p in module.parameters() if (found := _storage(p)) is not None)
        else:
            self._gathered.pop(module, None)

    def changed(self) -> bool:
        """Whether a parameter or buffer may have changed since the last walk. Every change to the
        model's static storages is one of: a parameter, buffer or module registered on one of its
        modules (assignment, `register_*`, PEFT injecting adapters, `load_state_dict(assign=True)`),
        which torch's global registration hooks report (`_registered`); or a value replaced under an
        existing name or a storage swapped in place, which bypass those hooks (`nn.Module._apply`
        behind `.to()` / `.cuda()` swaps `param.data` or, under `torch.__future__`'s overwrite or
        swap flags, the parameter, and always writes buffers straight into `_buffers`; FSDP2 and
        accelerate write `_parameters` directly), which re-reading the storage pointer and device of
        every remembered slot reveals (`_Slots`: no module walk, C-level maps). Equal pointers and
        devices in every slot are equal storage keys, so the exclusions and the device are what a
        walk would find. Only writing a new name straight into a module's `_parameters` /
        `_buffers` dict goes unseen: call `refresh` after that."""
        return self._stale or not self._slots.unchanged()

    def _watch_engines(self, modules: Iterable[nn.Module]) -> None:
        """Hooks after a sharding engine's own, registered once on every module it gathers the
        parameters of in a forward pre-hook: FSDP2's `fully_shard` modules, and the modules
        holding DeepSpeed ZeRO-3 parameters (marked `ds_id`), whose `param.data` its pre-hooks
        replace with the gathered whole. Their storages are excluded while gathered (the engine's
        hook, registered first, has gathered them), also when a recompute runs the module again in
        backward. Both engines replace the parameters' storages, so `changed` is true after."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # a torch without FSDP2
            FSDPModule = ()  # noqa: N806
        for module in modules:
            if module in self._watched:
                continue
            if isinstance(module, FSDPModule) or any(hasattr(p, "ds_id") for p in module.parameters(recurse=False)):
                self._watched.add(module)
                self._watch(module)

    def excludes(self, tensor: torch.Tensor) -> bool:
        """True for the storage of a parameter or buffer (static memory, never counted)."""
        found = _storage(tensor)
        return found is not None and self.is_static(found[0])

    def is_static(self, key: StorageKey) -> bool:
        """`excludes`, for a storage key the caller has."""
        if key in self._excluded:
            return True
        # called on every save: no generator made where no sharding engine gathers anything
        return bool(self._gathered) and any(key in keys for keys in self._gathered.values())
