"""`collector.ManualCollector`: the training loops' garbage collector, frozen after set-up,
collecting only at the iteration boundaries it is told of."""

import gc

import pytest

from bagualu_plugin.collector import ManualCollector


class Cycle:
    def __init__(self):
        self.me = self


def test_collections_happen_at_the_boundaries_only_and_everything_is_restored():
    assert gc.isenabled()
    before = gc.get_freeze_count()
    with ManualCollector(interval=2) as collector:
        assert not gc.isenabled() and gc.get_freeze_count() > before  # what existed is out of the collector
        Cycle()
        assert any(type(o) is Cycle for o in gc.get_objects())  # automatic collection is off: the cycle stays
        collector.step()
        assert any(type(o) is Cycle for o in gc.get_objects()) and collector.collections == 0  # 1 of 2
        collector.step()
        assert not any(type(o) is Cycle for o in gc.get_objects()) and collector.collections == 1
        assert collector.seconds > 0
    assert gc.isenabled() and gc.get_freeze_count() == before


def test_disabled_leaves_python_s_collector_alone():
    with ManualCollector(enabled=False) as collector:
        assert gc.isenabled()
        collector.step()
    assert collector.collections == 0 and gc.isenabled()


@pytest.mark.parametrize("interval", [0, 1.5, True])
def test_a_bad_interval_is_named(interval):
    with pytest.raises(ValueError, match=r"interval must be an int >= 1"):
        ManualCollector(interval=interval)
