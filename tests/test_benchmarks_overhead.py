"""benchmarks/overhead.py keeps what it measured: a row whose engine is not installed is skipped
with its reason, a failing row fails alone, and every row is printed and written as it completes."""

import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def overhead(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("overhead")


def _figures(plugin: float, plain: float) -> dict:
    return {"times": {"plugin": [plugin] * 3, "plain": [plain] * 3}, "planner_s_per_micro_batch": 0.001, "micro_batches": 4,
            "mitigated_micro_batches": 0, "tokens": 1024}


def test_rows_are_kept_as_they_complete_skipped_or_failed_alone(overhead, tmp_path, capsys):
    path = tmp_path / "rows.json"
    written = []

    def second():
        written.append(json.loads(path.read_text()))  # the first row is on disk before the second runs
        raise RuntimeError("the launch died")

    rows = [("plain row", (), lambda: _figures(1.0, 0.9)), ("broken row", (), second),
            ("ZeRO row", ("no_such_engine_installed",), lambda: pytest.fail("a row whose engine is missing must not run")),
            ("last row", (), lambda: _figures(2.0, 2.0))]
    out = overhead.measure(rows, str(path))
    assert [r["model"] for r in written[0]] == ["plain row"] and written[0][0]["ratio"] == pytest.approx(0.9)
    assert out[1]["failed"] == "failed: RuntimeError: the launch died"
    assert out[2]["skipped"] == "skipped: no_such_engine_installed not installed"
    assert out[3]["ratio"] == 1.0 and json.loads(path.read_text()) == out
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("plain row | 1.000 | 0.900 | 0.900x") and "the launch died" in printed[1]
