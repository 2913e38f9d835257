"""benchmarks/gpu_check.py in its reduced CPU mode: every check that needs no GPU runs (and
passes), the others are skipped, the table is printed and written to $OUT."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reduced_cpu_mode_passes_and_writes_its_table(gpu_check, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main(["--cpu", "--quick"]) == 0
    written = (tmp_path / "gpu_check.txt").read_text()
    assert written.strip() in capsys.readouterr().out
    rows = {line.split("  ")[0]: line.split()[-1] for line in written.split("\n\n")[0].splitlines()[2:]}
    ran = {name for name, status in rows.items() if status == "PASS"}
    assert "kernels: Triton vs reference, bitwise" in ran and "offload: delayed side streams + NaN churn" in ran
    assert rows["offload: D2H copies overlap compute"] == "SKIP" and "FAIL" not in rows.values()
    assert len(rows) == len(gpu_check.CHECKS) + 1  # and the environment row


def test_a_failing_check_is_a_row_and_the_exit_status(gpu_check, monkeypatch, capsys):
    def broken(ctx):
        raise RuntimeError("illegal memory access")

    monkeypatch.setattr(gpu_check, "CHECKS", [("broken", broken), *gpu_check.CHECKS[:1]])
    monkeypatch.delenv("OUT", raising=False)
    assert gpu_check.main(["--cpu", "--quick"]) == 1
    out = capsys.readouterr().out
    assert "RuntimeError: illegal memory access" in out and "1 fail" in out and "1 pass" in out
