"""Quantities with units and the hardware presets."""

import pytest
from pydantic import ValidationError

from bagualu_plugin.hardware import PRESETS, HardwareSpec, preset
from bagualu_plugin.units import fmt_bytes, fmt_seconds, parse_bandwidth, parse_bytes, parse_flops, parse_seconds


@pytest.mark.parametrize(
    "text, value",
    [("64GiB", 64 * 2**30), ("1.5 MB", 1_500_000), ("512 KiB", 524288), (4096, 4096), ("10B", 10)],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_rates_and_durations():
    assert parse_bandwidth("48 GB/s") == 48e9
    assert parse_bandwidth("400 Gb/s") == 50e9  # network links in bits
    assert parse_flops("480 TFLOP/s") == 480e12
    assert parse_seconds("10us") == pytest.approx(1e-5)
    assert parse_seconds(0.5) == 0.5


@pytest.mark.parametrize(
    "fn, bad, message",
    [
        (parse_bytes, "64 GiBs", "cannot read"),
        (parse_bytes, "1.5 B", "whole number"),
        (parse_bytes, -1, "non-negative"),
        (parse_bytes, True, "boolean"),
        (parse_bandwidth, "fast", "cannot read"),
        (parse_flops, "480 TB/s", "cannot read"),
        (parse_seconds, "10 min", "cannot read"),
        (parse_seconds, [1], "number or a string"),
    ],
)
def test_bad_quantities_are_rejected(fn, bad, message):
    with pytest.raises(ValueError, match=message):
        fn(bad)


def test_formatting():
    assert fmt_bytes(1536) == "1.50 KiB" and fmt_bytes(-2 * 2**30) == "-2.00 GiB" and fmt_bytes(12) == "12 B"
    assert fmt_seconds(0.0123) == "12.30 ms" and fmt_seconds(2e-9) == "2 ns"


def test_paper_accelerator_preset():
    """§VI-A: 480 TFLOP/s BF16, 64 GB HBM, 8 per node, 400 GB/s intra-node, 4 x 400 Gb/s per node;
    Fig. 6: 96 MB offloaded in 2.0 ms each way."""
    hw = preset("bagualu2")
    assert hw.peak_flops == 480e12 and hw.capacity_bytes == 64 * 2**30 and hw.devices_per_node == 8
    assert hw.intra_node_bandwidth == 400e9
    assert hw.inter_node_bandwidth * hw.devices_per_node == 4 * 400e9 / 8
    assert 96e6 / hw.host_link_bandwidth == pytest.approx(2.0e-3)


def test_presets_cover_the_issue_list_and_cpu_is_simulated():
    assert set(PRESETS) == {"bagualu2", "h100", "h200", "a100", "cpu"}
    assert preset("cpu").simulated and not preset("h200").simulated
    assert preset("h200").capacity_bytes > preset("h100").capacity_bytes > preset("bagualu2").capacity_bytes
    with pytest.raises(ValueError, match="known: a100, bagualu2, cpu, h100, h200"):
        preset("v100")


def test_hardware_fields_validate():
    fields = preset("h100").model_dump()
    assert HardwareSpec(**{**fields, "capacity_bytes": "40GiB"}).capacity_bytes == 40 * 2**30
    with pytest.raises(ValidationError, match="capacity_bytes"):
        HardwareSpec(**{**fields, "capacity_bytes": 0})
    with pytest.raises(ValidationError, match="devices_per_node"):
        HardwareSpec(**{**fields, "devices_per_node": "8"})
    with pytest.raises(ValidationError, match="extra"):
        HardwareSpec(**fields, hbm="fast")
