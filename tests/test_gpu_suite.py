"""benchmarks/gpu_suite.py: what a GPU image lacks is gathered as wheels, and the suite runs from
them in a private target, each part in its own process on a budget; CI runs its CPU mode, with the
wheels prepared for this Python beside this environment (its `pip freeze` as the image)."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def suite(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("gpu_suite")


def test_what_is_carried_is_what_the_image_lacks_at_the_version_needed_never_torch_or_cuda(suite):
    needed = {"torch": "2.11.0", "triton": "3.6.0", "nvidia-cudnn-cu13": "9.19", "cuda-bindings": "13.5", "trl": "1.16.0",
              "transformers": "5.17.0", "huggingface-hub": "1.34.0", "hjson": "3.1.0"}
    image = {"torch": "2.12.0", "transformers": "5.17.0", "huggingface-hub": "1.33.0"}
    assert suite.missing(needed, image) == {"hjson": "3.1.0", "huggingface-hub": "1.34.0", "trl": "1.16.0"}


def test_arguments_are_checked_by_name(suite, capsys):
    for argv, text in ((["--wheels", "w"], "--wheels needs --out"), (["--prepare", "d", "--budget", "0"], "--budget must be > 0"),
                       (["--prepare", "d", "--image", "torch", "--image-freeze", "f"], "give one of them")):
        with pytest.raises(SystemExit):
            suite.main(argv)
        assert text in capsys.readouterr().err


@pytest.mark.multiprocess
def test_prepared_wheels_run_the_suite_on_cpu_in_a_private_target(suite, tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text(subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout)
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    python = ".".join(map(str, sys.version_info[:2]))
    assert suite.main(["--prepare", str(wheels), "--python", python, "--image-freeze", str(freeze)]) == 0
    manifest = json.loads((wheels / suite.MANIFEST).read_text())
    names = {w["name"] for w in manifest["wheels"]}
    assert "bagualu-plugin" in names and "deepspeed" in names and not {"torch", "triton"} & names
    assert manifest["bytes"] <= suite.MAX_BYTES

    assert suite.main(["--wheels", str(wheels), "--out", str(out), "--cpu", "--budget", "600"]) == 0
    report = json.loads((out / "gpu_suite.json").read_text())
    assert [(p["name"], p["status"]) for p in report["parts"]] == [("checks", "PASS"), ("trainer", "PASS"), ("payoff", "PASS")]
    found = report["environment"]["found"]
    assert found["bagualu-plugin"][1] == str(out / "site")  # the carried plugin, not this checkout
    assert found["torch"] == [torch.__version__, torch.__file__] and not report["environment"]["unmet"]  # torch untouched
    assert " 0 fail" in (out / "checks" / "gpu_check.txt").read_text() and " 0 fail" in (out / "trainer" / "gpu_check.txt").read_text()
    policies = [r["policy"] for r in json.loads((out / "payoff.json").read_text())["payoff"]["policies"]]
    assert "adaptive" in policies and "hf_checkpointing" in policies and (out / "payoff-timeline.png").stat().st_size > 10_000


@pytest.mark.multiprocess
def test_a_part_over_its_budget_fails_alone(suite, tmp_path):
    slow = suite.Part("slow", ["-c", "import time; print('started', flush=True); time.sleep(60)"], 2.0, {})
    fast = suite.Part("fast", ["-c", "print('done')"], 30.0, {})
    for part in (slow, fast):
        suite.run_part(part, tmp_path / f"{part.name}.log")
    assert slow.status == "TIMEOUT after 2 s" and slow.seconds < 30 and (tmp_path / "slow.log").read_text() == "started\n"
    assert fast.status == "PASS" and fast.last_line == "done"
