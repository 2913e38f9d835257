"""Storage forms of offloaded activations (runtime/storage.py, runtime/hooks.py): the host pool's
reuse under changing sizes, the events buffers come back with, the counting of restored copies,
and bookkeeping that stays flat over a long run. The CUDA streams themselves are exercised by
benchmarks/gpu_check.py on a GPU."""

import gc
import random

import torch

import bagualu_plugin as bgl
from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.costmodel.plan import Plan
from bagualu_plugin.runtime import Ledger
from bagualu_plugin.runtime.hooks import _Offloads
from bagualu_plugin.runtime.plan_runtime import PlanRuntime
from bagualu_plugin.runtime.storage import HostCopy, HostPool, Stored, _size_class

IDS = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))


def test_size_classes_pinned_are_powers_of_two():
    """torch's pinned allocator rounds to powers of two: a finer class would waste the rest."""
    assert [_size_class(n, True) for n in (1, 4096, 4097, 5000, 1 << 20, (1 << 20) + 1)] == [4096, 4096, 8192, 8192, 1 << 20, 2 << 20]
    assert [_size_class(n, False) for n in (1, 4097, 5000, 9000)] == [4096, 4608, 5120, 9216]


def test_best_fit_reuses_a_larger_buffer_and_the_cap_lets_the_largest_go():
    pool = HostPool(max_free_bytes=100_000)
    buffers = [pool.take(n, False)[0] for n in (8192, 16384, 65536)]
    for b in buffers:
        pool.give(b, False)
    assert pool.made == 3 and pool.free_bytes == 90112
    assert pool.take(6000, False)[0].numel() == 8192  # the smallest that fits
    assert pool.take(9000, False)[0].numel() == 16384
    assert pool.take(200_000, False)[0].numel() == 212992 and pool.made == 4  # nothing fits
    assert pool.take(2000, False)[0].numel() == 4096 and pool.made == 5  # 65536 is over twice its class
    pool.give(torch.empty(40960, dtype=torch.uint8), False)
    assert pool.free_bytes == 40960 and list(pool._free) == [(False, 40960)]  # over the cap: 65536 went


def test_pool_stops_growing_while_expert_sizes_change():
    """Per-expert activation sizes change with routing every micro-batch; after the first few the
    pool serves every request from what it holds."""
    rng, pool, made = random.Random(0), HostPool(), []
    for _ in range(30):
        taken = [pool.take(int(300_000 * rng.uniform(0.6, 1.4)), False) for _ in range(16)]
        for buffer, _ in taken:
            pool.give(buffer, False)
        made.append(pool.made)
    assert made[5] == made[-1] and pool.taken == 30 * 16


def test_a_buffer_comes_back_with_the_event_of_its_last_copy():
    """A copy dropped before any reload still has its copy out running on a GPU: its buffer must
    come back with that event, and with the reload's once one ran (the reload waited for it)."""
    ledger, pool = Ledger(), HostPool()
    out, back = object(), object()  # the events a CUDA copy records, as the pool passes them on
    copy = HostCopy(torch.ones(100), ledger, pool)
    copy.copied = out
    copy.drop(torch.ones(100))
    buffer, done = pool.take(400, False)
    assert done is out and pool.made == 1
    pool.give(buffer, False, done)
    copy = HostCopy(torch.ones(100), ledger, pool)
    assert copy.buffer is buffer
    copy.copied, copy.loaded = out, back
    del copy
    assert pool.take(400, False)[1] is back


def test_restored_copies_count_on_the_device_while_alive():
    ledger, pool = Ledger(), HostPool()
    copy = HostCopy(torch.arange(100.0), ledger, pool)
    assert (ledger.live_host_bytes, ledger.live_device_bytes) == (4096, 0)
    flat = copy.restore()
    assert torch.equal(flat, torch.arange(100.0)) and ledger.live_device_bytes == 400
    assert copy.restore() is flat and ledger.live_device_bytes == 400  # a second saver shares it
    del flat
    assert ledger.live_device_bytes == 0


class Waits(Stored):
    """The CPU form of the seam a CUDA copy fills: `_ready` is where a reader's stream waits."""

    def __init__(self):
        super().__init__(torch.ones(4), Ledger())
        self.ready = 0

    def _load(self):
        return torch.ones(4)

    def _ready(self, flat):
        self.ready += 1


def test_every_saver_of_a_cached_restore_waits_for_it():
    stored = Waits()
    flat = stored.restore()
    assert stored.restore() is flat and stored.ready == 2


def test_hook_bookkeeping_stays_flat_over_many_iterations():
    """Micro-batch ids repeat every iteration: the chain of offload groups starts again with each
    forward, so neither it nor prefetch reaches into earlier iterations."""
    model = tiny_model("qwen3_moe")
    runtime = PlanRuntime(model).install()
    counts, lengths = [], []
    try:
        runtime.set_plan(Plan(dict.fromkeys(bgl.list_ops(model), "offload")))
        for _ in range(8):
            runtime.micro_batches.running = 0
            with runtime.forward():
                loss = model(input_ids=IDS, labels=IDS).loss
            group, length = runtime.micro_batches.get(0).offloads, 0
            while group is not None:
                group, length = group.before, length + 1
            lengths.append(length)
            loss.backward()
            del loss
            gc.collect()
            counts.append(sum(type(o) is _Offloads for o in gc.get_objects()))
    finally:
        runtime.remove()
    assert lengths[1] > 1 and len(set(lengths[1:])) == 1  # (the first forward also offloads RoPE's cache)
    # only the latest chain is left: the copy of a storage that outlives the backward (the input
    # ids, while IDS lives) dies with its savers, not with the storage
    assert counts[1] == counts[-1] == lengths[-1]
    assert len(runtime.hooks._forms) < 50


def test_a_runtime_built_before_the_model_moves_follows_it():
    """`.cuda()` after the runtime was built gives the parameters new storages (and device): the
    runtime looks again at each forward. Moving to bf16 does the same on CPU."""
    model = tiny_model("qwen3_moe")
    early = PlanRuntime(model).install()
    model.to(torch.bfloat16)
    try:
        with early.forward():
            loss = model(input_ids=IDS, labels=IDS).loss
        counted = early.ledger.live_device_bytes
        del loss
    finally:
        early.remove()
    with bgl.apply_plan(model, {}) as ledger:
        loss = model(input_ids=IDS, labels=IDS).loss  # noqa: F841 - its graph keeps the saved tensors alive
        assert counted == ledger.live_device_bytes
