"""`runtime.micro_batches`: the one owner of per-micro-batch state."""

import pytest

from bagualu_plugin.runtime.micro_batches import MicroBatches


def test_states_are_made_on_first_use_and_go_with_their_backward():
    states = MicroBatches()
    assert states.get(0) is None and not list(states) and states.awaiting() == []
    first = states.of(2)
    assert states.of(2) is first and first.index == 2 and first.regions == {} and first.offloads is None
    states.of(0).event = states.of(2).event = "event"
    states.of(1)
    assert states.awaiting() == [0, 2]  # in order, whatever order they came in
    states.release(2)
    assert states.get(2) is None and states.awaiting() == [0] and [s.index for s in states] == [0, 1]
    states.release(7)  # nothing to release: nothing happens


def test_charging_runs_another_micro_batch_and_gives_the_running_one_back():
    states = MicroBatches()
    states.running = 3
    with states.charging(1):
        assert states.running == 1
    with pytest.raises(RuntimeError), states.charging(0):
        assert states.running == 0
        raise RuntimeError("backward work failed")
    assert states.running == 3
