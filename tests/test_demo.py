"""The spike demo's policies on the built-in demo recipe (short runs; numbers live in benchmarks)."""

from bagualu_plugin import load_recipe
from bagualu_plugin.demo import run_policy


def test_adaptive_survives_spikes_that_crash_the_unmitigated_policy():
    recipe = load_recipe("demo")
    spiky = recipe.model_copy(update={"spikes": recipe.spikes.model_copy(update={"spike_probability": 1.0, "spike_max_imbalance": 2.6, "normal_max_imbalance": 1.2})})
    adaptive = run_policy("adaptive", spiky, steps=2)
    assert adaptive.ooms == 0 and adaptive.steps_completed == 2
    assert adaptive.peak_device_bytes <= recipe.hardware.capacity_bytes
    none = run_policy("none", spiky, steps=2)
    assert none.ooms >= 1  # then it restarts with full recompute, as the paper's baselines do
    assert none.steps_completed == 2 - none.ooms
