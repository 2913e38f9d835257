"""benchmarks/expert_parallel.py at its smallest: 2 gloo ranks, 64 tokens, H=32, one repeat; the
table has its columns and every time is positive (the numbers live in the benchmark's runs)."""

import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = pytest.mark.multiprocess  # the benchmark spawns its gloo ranks


def test_smallest_run_prints_its_table_and_writes_positive_times(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # spawned ranks import the worker by module name
    bench = importlib.import_module("expert_parallel")
    out = tmp_path / "ep.json"
    argv = ["--ep", "2", "--tokens", "64", "--hidden", "32", "--repeats", "1", "--deadline", "60", "--json", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    header = printed.split("\n\n")[1].splitlines()[0].split()
    for column in ("ep", "tokens/rank", "route", "dispatch", "combine", "dispatch+combine", "bwd", "total", "GB/s"):
        assert column in header
    assert "hot rank 0" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["ep"], r["tokens_per_rank"], r["skew"]) for r in rows] == [(2, 64, 0.0), (2, 64, 0.5)]
    for r in rows:
        assert len(r["ranks"]) == 2 and r["mb_sent_per_rank"] > 0 and r["gb_per_s"] > 0
        assert all(s > 0 for rank in r["ranks"] for s in rank["seconds"].values())
        assert all(rank["seconds"]["total"] >= rank["seconds"]["dispatch fwd"] + rank["seconds"]["bwd"] for rank in r["ranks"])
        assert sum(sum(rank["pairs_received"]) for rank in r["ranks"]) == 2 * 64 * 2  # every pair reached a rank
    assert rows[1]["rank0_share"] > rows[0]["rank0_share"]
