"""Spike schedules from a recipe's spikes section (paper §II-B)."""

import pytest

from bagualu_plugin.config import Spikes
from bagualu_plugin.spikes import imbalance_schedule, skew_fraction


def test_schedule_follows_the_paper_distribution_and_is_seeded():
    spikes = Spikes(enabled=True, seed=3)  # 2.9% of iterations spike, up to 2.6x; others under 1.2x
    schedule = imbalance_schedule(spikes, iterations=2000, micro_batches=4, moe_layers=[1, 2])
    assert schedule == imbalance_schedule(spikes, iterations=2000, micro_batches=4, moe_layers=[1, 2])
    spiking = [it for it in schedule if max(v for mb in it for v in mb.values()) > 1.2]
    assert 0.02 < len(spiking) / len(schedule) < 0.04
    assert all(1.0 <= v <= 2.6 for it in schedule for mb in it for v in mb.values())
    for it in spiking:  # one micro-batch spikes, on every MoE layer
        assert sum(any(v > 1.2 for v in mb.values()) for mb in it) == 1


def test_schedule_respects_chosen_layers_micro_batches_and_switch():
    spikes = Spikes(enabled=True, seed=0, spike_probability=1.0, layers=[2], micro_batches=[3])
    for it in imbalance_schedule(spikes, iterations=20, micro_batches=4, moe_layers=[1, 2]):
        assert it[3][2] > 1.2 and all(v <= 1.2 for mb, row in enumerate(it) for layer, v in row.items() if (mb, layer) != (3, 2))
    off = imbalance_schedule(Spikes(enabled=False, spike_probability=1.0), 50, 4, [1])
    assert all(v <= 1.2 for it in off for mb in it for v in mb.values())
    with pytest.raises(ValueError, match="iterations"):
        imbalance_schedule(spikes, 0, 4, [1])


def test_skew_fraction():
    assert skew_fraction(1.0, 4) == 0.0 and skew_fraction(4.0, 4) == 1.0 and skew_fraction(2.5, 4) == 0.5
    with pytest.raises(ValueError, match="ep_size"):
        skew_fraction(1.5, 1)
    with pytest.raises(ValueError, match="imbalance"):
        skew_fraction(5.0, 4)
