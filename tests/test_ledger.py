"""The activation Ledger (docs/architecture.md) against hand counts and an independent enumeration."""

import threading
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from bagualu_plugin.runtime import Ledger, Record, SimulatedOutOfMemoryError

F32 = 4


def saved_bytes(run, model=None):
    """Independent count of what ``run()`` leaves saved for backward: own hooks, unique storage
    pointers among the saved tensors still alive, parameters and buffers excluded."""
    static = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())} if model else set()
    saved = []

    def pack(t):
        alias = t.detach()
        saved.append(weakref.ref(alias))
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    storages = {a.untyped_storage().data_ptr(): a.untyped_storage().nbytes() for ref in saved if (a := ref()) is not None}
    return sum(n for ptr, n in storages.items() if ptr not in static), out


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 3))


# ---------------------------------------------------------------- what is counted


def test_mlp_hand_computed():
    # Input without grad: addmm of layer 1 saves only x (for the weight grad), SiLU saves its input,
    # addmm of layer 2 saves the SiLU output and W2.t() (a parameter view: excluded).
    model, x = mlp(), torch.randn(5, 4)
    ledger = Ledger.for_model(model)
    with ledger.track():
        loss = model(x).sum()
    assert [r.nbytes for r in ledger.records()] == [5 * 4 * F32, 5 * 8 * F32, 5 * 8 * F32]
    assert ledger.live_device_bytes == 400
    assert ledger.live_host_bytes == 0
    del loss
    assert ledger.live_device_bytes == 0


def test_mlp_matches_independent_enumeration():
    model, x = mlp(), torch.randn(5, 4, requires_grad=True)
    expected, _ = saved_bytes(lambda: model(x).sum(), model)
    ledger = Ledger.for_model(model)
    with ledger.track():
        loss = model(x).sum()  # noqa: F841 - its graph keeps the saved tensors alive
    assert ledger.live_device_bytes == expected == 400


def test_elementwise_hand_computed():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)  # not a parameter: counted
    ledger = Ledger()
    with ledger.track():
        y = (x * w).sum()  # mul saves both operands, sum saves only a shape
    assert ledger.live_device_bytes == (12 + 4) * F32
    y.backward()
    assert ledger.live_device_bytes == 0


def test_parameters_buffers_and_their_views_are_excluded():
    lin = nn.Linear(6, 5, bias=False)
    lin.register_buffer("scale", torch.randn(5))
    x = torch.randn(2, 6, requires_grad=True)

    def run():
        # mm saves x and weight.t(); "* scale" saves only the buffer (the buffer needs no grad);
        # "* weight[:, 0]" saves the product (for the weight grad) and the weight view.
        return (lin(x) * lin.scale * lin.weight[:, 0]).sum()

    counted, included = Ledger.for_model(lin), Ledger()
    with counted.track():
        out1 = run()
    with included.track():
        out2 = run()
    activations = 2 * 6 * F32 + 2 * 5 * F32  # x, lin(x) * scale
    assert counted.live_device_bytes == activations
    assert included.live_device_bytes == activations + (5 * 6 + 5) * F32
    del out1, out2


def test_same_storage_counts_once_and_a_view_charges_the_whole_storage():
    x = torch.randn(10, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    ledger = Ledger()
    with ledger.track():
        y = (x * x).sum() + (x[:2] * w).sum() + (x.t()[0] * x.t()[1]).sum()
    assert ledger.live_device_bytes == (40 + 4) * F32
    assert len(ledger.records()) == 2
    del y
    assert ledger.live_device_bytes == 0


class Wrapper(torch.Tensor):
    """A wrapper subclass (like DTensor or a jagged nested tensor): its storage has no data."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_no_storage_tensors_are_skipped():
    ledger = Ledger()
    kept = [torch.empty(3, device="meta"), torch.eye(3).to_sparse(), torch.empty(0), Wrapper((3, 4))]
    for t in kept:
        ledger.record(t)
    assert ledger.live_device_bytes == 0 and ledger.records() == []


def test_record_rejects_unknown_residency():
    with pytest.raises(ValueError, match="residency"):
        Ledger().record(torch.ones(2), "disk")
    with pytest.raises(ValueError, match="residency"):
        Ledger().by_op("disk")


# ---------------------------------------------------------------- liveness


def test_backward_releases_everything_and_peak_stays():
    model, x = mlp(), torch.randn(5, 4)
    ledger = Ledger.for_model(model)
    with ledger.track():
        loss = model(x).sum()
    loss.backward()  # x is still referenced here: only the graph's hold counts
    assert ledger.live_device_bytes == 0
    assert ledger.peak_device_bytes == 400
    with ledger.track():
        loss = model(x[:2]).sum()
    assert ledger.peak_device_bytes == 400
    ledger.reset_peak()
    assert ledger.peak_device_bytes == ledger.live_device_bytes == 5 * 4 * F32 + 2 * 2 * 8 * F32
    del loss
    assert ledger.live_device_bytes == 0
    assert ledger.peak_device_bytes == 5 * 4 * F32 + 2 * 2 * 8 * F32


def test_graph_dropped_without_backward_is_released():
    # sigmoid saves its output: a pack hook that kept the tensor itself would make an uncollectable
    # cycle output -> grad_fn -> saved output, and these bytes would never be released.
    x = torch.randn(8, requires_grad=True)
    ledger = Ledger()
    with ledger.track():
        y = (x * 2).sin().sigmoid()
    assert ledger.live_device_bytes == 2 * 8 * F32
    del y
    assert ledger.live_device_bytes == 0


def test_inplace_change_of_a_saved_tensor_still_fails_backward():
    x = torch.randn(4, requires_grad=True)
    y = x.clone()
    ledger = Ledger()
    with ledger.track():
        z = (x * y).sum()
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_micro_batches_split_and_release_independently():
    model = mlp()
    ledger = Ledger.for_model(model)
    losses = []
    for mb, rows in [(0, 5), (1, 3)]:
        ledger.micro_batches.running = mb
        with ledger.track():
            losses.append(model(torch.randn(rows, 4)).sum())
    per_row = (4 + 8 + 8) * F32
    assert ledger.by_micro_batch() == {0: 5 * per_row, 1: 3 * per_row}
    losses[0].backward()
    assert ledger.by_micro_batch() == {1: 3 * per_row}
    assert ledger.live_device_bytes == 3 * per_row
    assert ledger.peak_device_bytes == 8 * per_row
    assert all(r.micro_batch == 1 for r in ledger.records())


def test_current_op_attribution():
    op = ["norm"]
    ledger = Ledger(current_op=lambda: op[0])
    x = torch.randn(6, requires_grad=True)
    with ledger.track():
        h = x.sin()  # saves x
        op[0] = "act"
        a = h.exp()  # saves its output
        op[0] = "mix"
        y = (a * x).sum()  # saves a (already "act") and x (already "norm"): no new bytes
    assert ledger.by_op() == {"norm": 6 * F32, "act": 6 * F32}
    assert [(r.op, r.savers) for r in ledger.records()] == [("norm", ("norm", "mix")), ("act", ("act", "mix"))]
    assert ledger.by_op("host") == {}
    del h, a, y
    assert ledger.by_op() == {}


def test_new_storage_at_a_reused_address_is_a_new_record():
    buf = np.zeros(64, dtype=np.float32)
    ledger = Ledger()
    ledger.micro_batches.running = 0
    first = torch.from_numpy(buf)
    ledger.record(first)
    again = torch.from_numpy(buf)  # another storage object on the same memory, while it is live
    ledger.record(again)
    assert ledger.live_device_bytes == 64 * F32
    del first, again
    assert ledger.live_device_bytes == 0
    ledger.micro_batches.running = 1
    reused = torch.from_numpy(buf)  # a new storage at the old address: a stale entry would hide it
    assert reused.untyped_storage().data_ptr() == buf.ctypes.data
    ledger.record(reused)
    assert ledger.live_device_bytes == 64 * F32
    assert ledger.by_micro_batch() == {1: 64 * F32}


def test_repeated_graphs_reuse_addresses_without_stale_counts():
    model = mlp()
    ledger = Ledger.for_model(model)
    for mb in range(4):
        ledger.micro_batches.running = mb
        with ledger.track():
            loss = model(torch.randn(5, 4)).sum()
        assert ledger.by_micro_batch() == {mb: 400}
        loss.backward()
        del loss
        assert ledger.live_device_bytes == 0


def test_host_records_count_as_host():
    ledger = Ledger()
    kept = torch.ones(10)
    ledger.record(kept, "host")
    assert (ledger.live_host_bytes, ledger.live_device_bytes, ledger.peak_device_bytes) == (40, 0, 0)
    assert ledger.by_op("host") == {None: 40}
    del kept
    assert ledger.live_host_bytes == 0


def test_cpu_tensors_under_a_cuda_ledger_are_host():
    model = mlp()
    ledger = Ledger.for_model(model, device="cuda")  # no GPU needed: nothing reads the allocator
    with ledger.track():
        loss = model(torch.randn(5, 4)).sum()
    assert (ledger.live_host_bytes, ledger.live_device_bytes) == (400, 0)
    del loss


def test_releases_from_other_threads():
    ledger = Ledger()
    tensors = [torch.full((16,), float(i)) for i in range(200)]
    for t in tensors:
        ledger.record(t)
    del t
    assert ledger.live_device_bytes == 200 * 16 * F32
    chunks = [tensors[i::4] for i in range(4)]
    del tensors

    seen, errors = [], []  # what the threads saw, checked here: a failed assert in a thread fails nothing

    def drop(chunk):
        try:
            while chunk:
                chunk.pop()
                seen.append(ledger.live_device_bytes)
        except Exception as exc:  # handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=drop, args=(c,)) for c in chunks]
    del chunks
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(seen) == 200 and all(0 <= b < 200 * 16 * F32 and b % (16 * F32) == 0 for b in seen)
    assert ledger.live_device_bytes == 0 and ledger.records() == []


# ---------------------------------------------------------------- simulated capacity, allocator


def test_simulated_capacity_raises_before_counting():
    ledger = Ledger(capacity_bytes=1000, static_bytes=600, current_op=lambda: "expert_fc1")
    ledger.micro_batches.running = 3
    kept = torch.ones(50)  # 200 bytes: static 600 + 200 <= 1000
    ledger.record(kept)
    before = (ledger.live_device_bytes, ledger.peak_device_bytes, ledger.records(), ledger.by_op())
    big = torch.ones(51)  # 204 bytes: 600 + 200 + 204 > 1000
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        ledger.record(big)
    assert isinstance(info.value, torch.OutOfMemoryError)
    message = str(info.value)
    for part in ["simulated", "1000", "600", "200", "204", "'expert_fc1'", "micro-batch 3"]:
        assert part in message
    assert (ledger.live_device_bytes, ledger.peak_device_bytes, ledger.records(), ledger.by_op()) == before
    ledger.record(kept[:10])  # the same live storage needs no new memory
    ledger.record(big, "host")  # host memory is not device capacity
    assert ledger.live_device_bytes == 200 and ledger.live_host_bytes == 204
    fits = torch.ones(50)  # exactly at capacity is fine
    ledger.record(fits)
    assert ledger.live_device_bytes == ledger.peak_device_bytes == 400


def test_simulated_capacity_stops_a_forward():
    model = mlp()
    ledger = Ledger.for_model(model, capacity_bytes=1000, static_bytes=700)
    with ledger.track(), pytest.raises(torch.OutOfMemoryError, match="simulated"):
        model(torch.randn(5, 4)).sum()
    assert ledger.live_device_bytes == 0
    assert ledger.peak_device_bytes == 5 * 4 * F32 + 5 * 8 * F32  # x and the SiLU input fitted


def test_allocator_is_read_only_on_cuda():
    ledger = Ledger()
    with pytest.raises(RuntimeError, match="only read on CUDA"):
        ledger.allocated_bytes()
    with pytest.raises(RuntimeError, match="only read on CUDA"):
        ledger.max_allocated_bytes()


def test_record_fields():
    ledger = Ledger(source=lambda t: f"made {tuple(t.shape)}")
    kept = torch.ones(2, 3, dtype=torch.float16)[0]
    ledger.record(kept)
    ledger.record(kept.float())  # a temporary: released at once
    (record,) = ledger.records()
    assert isinstance(record, Record)
    assert (record.nbytes, record.residency, record.dtype, record.source) == (12, "device", torch.float16, "made (3,)")
    assert record.savers == (None,) and record.micro_batch is None
    with pytest.raises(AttributeError):
        record.nbytes = 0


# ---------------------------------------------------------------- a tiny HF MoE model


def test_tiny_qwen3_moe_forward_and_backward():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = torch.randint(0, 128, (2, 16))

    expected, out = saved_bytes(lambda: model(input_ids=ids, labels=ids).loss, model)
    del out
    ledger = Ledger.for_model(model)
    with ledger.track():
        loss = model(input_ids=ids, labels=ids).loss
    assert ledger.live_device_bytes == expected > 0
    assert ledger.peak_device_bytes == expected
    loss.backward()
    assert ledger.live_device_bytes == 0
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------- device and copies in flight


class Copy:
    """A copy still running until `finish()`: what the Ledger reads of a CUDA event."""

    def __init__(self):
        self.done, self.waited = False, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def test_device_is_the_models():
    """PlanRuntime and the profiler pass no device: the ledger takes the device of the parameters
    off the CPU (a CUDA tensor's carries its index; `benchmarks/gpu_check.py` runs it on a GPU),
    looked up again by refresh() (PlanRuntime.forward calls it when a parameter changed), so the
    allocator is read where the model computes. Meta parameters (another pipeline stage's, never loaded) compute nowhere."""
    from bagualu_plugin.runtime.ledger import model_device

    assert Ledger.for_model(mlp()).device == torch.device("cpu") and model_device([]) == torch.device("cpu")
    with torch.device("meta"):
        model = mlp()
    assert Ledger.for_model(model).device == torch.device("cpu")
    assert model_device([torch.empty(1, device="meta"), torch.ones(1)]) == torch.device("cpu")
    assert Ledger.for_model(model, device="meta").device == torch.device("meta")  # an explicit one wins


def test_the_ledger_walks_again_only_when_a_static_tensor_changed():
    """`refresh_if_changed` (what `track` and PlanRuntime.forward call): no walk while nothing
    changed, nor for modules registered outside the model; one after each change, which it then
    excludes, explicit `exclude` tensors included."""
    model, extra = mlp(), torch.ones(3)
    ledger = Ledger.for_model(model, exclude=[extra])
    walks = []
    refresh = ledger.refresh
    ledger.refresh = lambda: walks.append(1) or refresh()
    nn.Linear(2, 2)  # another model's registrations
    assert not ledger.refresh_if_changed() and walks == []

    def changed(change) -> bool:
        change()
        return ledger.refresh_if_changed() and not ledger.refresh_if_changed()

    assert changed(lambda: model.to(torch.float64))
    assert changed(lambda: setattr(model[0], "bias", nn.Parameter(torch.zeros(8, dtype=torch.float64))))
    assert changed(lambda: model[2].register_buffer("scale", torch.ones(3, dtype=torch.float64)))
    assert changed(lambda: setattr(extra, "data", torch.ones(3)))
    assert changed(lambda: model[2]._parameters.__setitem__("bias", None))
    assert len(walks) == 5
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    with ledger.track():
        out = (model(x) * model[2].scale * extra).sum()
    assert len(walks) == 5 and all(ledger.excludes(t) for t in (*model.parameters(), *model.buffers(), extra))
    assert ledger.live_device_bytes == (5 * 4 + 2 * 5 * 8) * 8  # x, SiLU's input and output: the products save the buffer and `extra`
    del out


def test_copies_in_flight_count_until_done_and_are_capped():
    ledger = Ledger()
    source, other = torch.ones(10), torch.ones(30)
    first, second = Copy(), Copy()
    ledger.in_flight(source, first)
    ledger.in_flight(other, second)
    del source, other  # the allocator keeps them until their copies have passed
    assert ledger.live_device_bytes == ledger.in_flight_bytes == 160 and ledger.peak_device_bytes == 160
    ledger.wait_in_flight(150)  # over the cap: the host waits for the oldest copy only
    assert first.waited and not second.waited and ledger.live_device_bytes == 120
    second.done = True
    assert ledger.live_device_bytes == 0 and ledger.peak_device_bytes == 160
    ledger.reset_peak()
    assert ledger.peak_device_bytes == 0


def test_a_ledger_can_record_its_first_overrun_instead_of_raising():
    kept = [torch.zeros(256) for _ in range(3)]  # 1 KiB each
    ledger = Ledger(capacity_bytes=2500)
    ledger.record(kept[0])
    ledger.record(kept[1])
    with pytest.raises(SimulatedOutOfMemoryError):
        ledger.record(kept[2])  # the default: raise, as a GPU does
    ledger.on_overrun = "record"
    ledger.record(kept[2])
    ledger.record(torch.zeros(512))
    overrun = ledger.take_overrun()
    assert overrun.requested_bytes == 1024 and overrun.live_bytes == 2048  # the first save that did not fit
    assert ledger.take_overrun() is None and ledger.peak_device_bytes == 3 * 1024 + 2048  # and it went on counting
    with pytest.raises(ValueError, match="on_overrun"):
        ledger.on_overrun = "ignore"


# ---------------------------------------------------------------- spilling past the capacity


def _sines(x: torch.Tensor) -> torch.Tensor:
    """Four sines: each saves its input (x, then three intermediates the forward drops at once)."""
    return x.sin().sin().sin().sin()


def test_a_save_past_spill_at_moves_the_earliest_activations_only_the_graph_holds_to_the_host():
    x = torch.randn(8, requires_grad=True)  # 32 bytes; the caller holds x: moving its saved copy frees nothing
    reference = torch.autograd.grad(_sines(x).sum(), x)[0]
    ledger = Ledger(capacity_bytes=96, current_op=lambda: "sine")
    ledger.spill_at = 96
    with ledger.track():
        y = _sines(x)  # x, a1, a2 fit; saving a3 moves a1, the earliest only the graph holds, to the host
    assert (ledger.live_device_bytes, ledger.live_host_bytes, ledger.spilled_bytes) == (96, 32, 32)
    assert [r.residency for r in ledger.records()] == ["device", "device", "device", "spilled"]
    assert ledger.by_op("spilled") == {"sine": 32} and ledger.peak_device_bytes == 96
    (grad,) = torch.autograd.grad(y.sum(), x)  # a1 comes back when backward reaches it: a3 and a2 are gone
    assert torch.equal(grad, reference)
    assert (ledger.live_device_bytes, ledger.live_host_bytes, ledger.peak_device_bytes) == (0, 0, 96) and not ledger.records()


def test_spilled_activations_of_a_graph_dropped_without_backward_are_released():
    x = torch.randn(8, requires_grad=True)
    ledger = Ledger(capacity_bytes=96)
    ledger.spill_at, ledger.micro_batches.running = 96, 0
    with ledger.track():
        y = _sines(x)
    assert ledger.by_micro_batch("spilled") == {0: 32}
    ledger.retire(0)  # an abandoned micro-batch's records, the spilled one too, become no micro-batch's
    assert ledger.by_micro_batch("spilled") == {None: 32}
    del y
    assert (ledger.live_device_bytes, ledger.live_host_bytes) == (0, 0) and not ledger.records()


def test_what_cannot_be_spilled_still_runs_out_of_memory():
    x = torch.randn(8, requires_grad=True)
    held = []
    ledger = Ledger(capacity_bytes=96)
    ledger.spill_at = 96
    with ledger.track(), pytest.raises(SimulatedOutOfMemoryError):  # the forward keeps every activation itself
        y = x
        for _ in range(4):
            y = y.sin()
            held.append(y)
    assert ledger.spilled_bytes == 0
    ledger = Ledger(capacity_bytes=96)  # no spill_at: the capacity alone
    with ledger.track(), pytest.raises(SimulatedOutOfMemoryError):
        _sines(x)


class _Product(torch.autograd.Function):
    """a * b, saving a then b: its backward unpacks them in that order."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad * b, grad * a


def test_what_backward_has_unpacked_is_never_spilled_to_restore_another():
    """A tensor that needs no gradient comes back from autograd's unpack as the very alias the
    Ledger holds: nothing but the mark tells that backward computes with it."""

    def run(x, hold):
        mask = (x > 0).float()
        hold.append(mask)
        return _Product.apply(mask, x.cos()).exp()

    x = torch.randn(8, requires_grad=True)
    reference = torch.autograd.grad(run(x, []).sum(), x)[0]
    ledger = Ledger(current_op=lambda: "product")
    ledger.spill_at = 96
    held = []
    with ledger.track():
        z = run(x, held)  # saving exp's output spills cos(x): the mask is held here, x by the caller
    assert ledger.spilled_bytes == 32
    held.clear()  # the mask is the graph's alone now
    ledger.spill_at = 64  # restoring cos(x) in backward must make room: the mask, unpacked just before, is in use
    (grad,) = torch.autograd.grad(z.sum(), x)
    assert torch.equal(grad, reference) and ledger.spilled_bytes == 32
