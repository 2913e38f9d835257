"""Every GPU measurement in one command, for a GPU slot of minutes on a machine without network.

On a machine with the package registries, gather what the GPU image lacks:

    python benchmarks/gpu_suite.py --prepare DIR [--python 3.12] [--image REQUIREMENT ...]

DIR gets the plugin's own wheel, DeepSpeed's (PyPI ships it as source only: built here without its
ops, which compile at first use), and the wheels of every other package the suite needs that the
image does not hold at the version needed, for the image's Python and Linux x86-64: torch, Triton
and CUDA's libraries are never carried (the image's stay). What the image holds is resolved from
`--image` (default `IMAGE`: a CUDA image with torch 2.11, transformers 5.17, accelerate 1.15, PEFT,
datasets and matplotlib), or from its `pip freeze` in a file (`--image-freeze FILE`). At most
`MAX_BYTES` (60 MiB): an image without datasets needs pyarrow's 52 MiB, too much to carry.

On the GPU machine, offline:

    python benchmarks/gpu_suite.py --wheels DIR --out OUT [--budget 540]

installs DIR's wheels into OUT/site (a private target: nothing of the image changes, torch least
of all), checks every requirement of the plugin, TRL and DeepSpeed against what is then importable,
and runs each part in its own process on a time budget, a part that fails or overruns failing only
itself: `gpu_check.py` (the CUDA paths), its Trainer rows apart (FSDP2, DeepSpeed ZeRO-2 / ZeRO-3,
`accelerate launch`), and `gpu_payoff.py` (its four tables, the alternatives users reach for
included, and its timeline picture), in at most `--budget` seconds (9 minutes) on one H100 or H200.
OUT gets every part's log, `gpu_check`'s tables, the payoff's JSON and picture, and
`gpu_suite.json`; the summary is printed last. `--cpu` runs the same on the CPU, small (CI).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The H200's image of 2026-12-04, as its run shows it: torch, transformers, accelerate and PEFT, and
# datasets and matplotlib, which TRL and the plugin imported there without being carried
IMAGE = ("torch==2.11.0", "transformers==5.17.0", "accelerate==1.15.0", "peft", "datasets", "matplotlib")
SUITE = ("trl", "peft", "accelerate", "deepspeed")  # beyond the plugin's own dependencies: the Trainer rows' clients
NEVER = ("torch", "triton")  # nor nvidia-* and cuda-*: the image's CUDA stack stays as it is
MAX_BYTES = 60 << 20
MANIFEST = "gpu-suite.json"
PLATFORMS = (*(f"manylinux_2_{m}_x86_64" for m in range(28, 4, -1)), "manylinux2014_x86_64", "manylinux2010_x86_64",
             "manylinux1_x86_64")  # pip takes a platform as named, not the older ones it implies: all of them
CHECKED = ("bagualu-plugin", "trl", "deepspeed", "peft", "accelerate", "transformers")  # their requirements, after the install


def _never(name: str) -> bool:
    name = canonicalize_name(name)
    return name in NEVER or name.startswith(("nvidia-", "cuda-"))


# ---------------------------------------------------------------- --prepare


def _pip(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"pip {' '.join(args[:2])} failed:\n{done.stderr.strip()[-3000:]}")
    return done


def resolve(requirements: list[str], python: str, constraints: list[str], links: Path | None = None) -> dict[str, str]:
    """{name: version} that pip installs for `requirements` (with their dependencies) on Linux
    x86-64 under `python`, wheels only, each of `constraints` holding (a dry run: nothing is
    downloaded but metadata)."""
    with tempfile.TemporaryDirectory() as tmp:
        pins = Path(tmp, "constraints.txt")
        pins.write_text("\n".join(constraints) + "\n")
        report = Path(tmp, "report.json")
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--target", str(Path(tmp, "target")), "--report", str(report),
             "--only-binary", ":all:", "--python-version", python, *platforms, *(["--find-links", str(links)] if links else []),
             *requirements, env={**os.environ, "PIP_CONSTRAINT": str(pins)})  # in place of this machine's own constraints
        installs = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}


def missing(needed: dict[str, str], image: dict[str, str]) -> dict[str, str]:
    """What the suite needs that the image does not hold at that version, torch's stack aside."""
    return {name: version for name, version in sorted(needed.items()) if image.get(name) != version and not _never(name)}


def _image(args) -> tuple[list[str], dict[str, str]]:
    """The image's requirements and what they install (a freeze file: its lines, as they are)."""
    if args.image_freeze:
        lines = [line.strip() for line in Path(args.image_freeze).read_text().splitlines()]
        pins = [line for line in lines if line and not line.startswith(("#", "-e ")) and "==" in line]
        return pins, {canonicalize_name(p.split("==")[0]): p.split("==")[1].strip() for p in pins}
    image = list(args.image or IMAGE)
    return image, resolve(image, args.python, [])


def prepare(args) -> int:
    out = Path(args.prepare)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise SystemExit(f"--prepare {out}: the folder is not empty (its wheels would be carried too)")
    began = time.perf_counter()
    image, held = _image(args)
    print(f"the image: {args.image_freeze or ' '.join(image)}: {len(held)} distributions", flush=True)
    # the plugin as it is here, and DeepSpeed built without its ops against this machine's torch
    _pip("wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT))
    _pip("wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out), args.deepspeed,
         env={**os.environ, "DS_BUILD_OPS": "0", "PIP_CONSTRAINT": ""})
    built = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in out.glob("*.whl")}
    plugin = built[canonicalize_name("bagualu-plugin")]
    needed = resolve([str(plugin), *SUITE], args.python, image, links=out)  # beside the image: its requirements hold
    carry = {n: v for n, v in missing(needed, held).items() if n not in built}
    if carry:
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        _pip("download", "--no-deps", "--quiet", "--only-binary", ":all:", "--python-version", args.python, *platforms, "-d", str(out),
             *(f"{n}=={v}" for n, v in carry.items()), env={**os.environ, "PIP_CONSTRAINT": ""})
    wheels = sorted(out.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    rows = [{"file": w.name, "name": canonicalize_name(parse_wheel_filename(w.name)[0]), "version": str(parse_wheel_filename(w.name)[1]),
             "bytes": w.stat().st_size} for w in wheels]
    if total > MAX_BYTES:
        biggest = ", ".join(f"{r['file']} ({r['bytes'] / 2**20:.1f} MiB)" for r in sorted(rows, key=lambda r: -r["bytes"])[:5])
        raise SystemExit(f"--prepare: {total / 2**20:.1f} MiB of wheels, over the {MAX_BYTES >> 20} MiB to carry; the largest: {biggest}")
    manifest = {"python": args.python, "image": image, "wheels": rows, "bytes": total, "made": time.strftime("%Y-%m-%d"),
                "needed": needed}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(rows)} wheels, {total / 2**20:.1f} MiB, in {out} ({time.perf_counter() - began:.0f} s):")
    for r in rows:
        print(f"  {r['file']}  {r['bytes'] / 2**20:.2f} MiB")
    return 0


# ---------------------------------------------------------------- --wheels


@dataclass
class Part:
    """One part of the suite: a script and its arguments, in its own process, on a time budget."""

    name: str
    argv: list[str]
    budget_s: float
    env: dict
    status: str = "not run"
    seconds: float = 0.0
    returncode: int | None = None
    last_line: str = ""


def install(wheels: Path, site: Path) -> list[str]:
    """DIR's wheels that this Python does not hold at their version, installed into `site`, the
    plugin's always (the suite runs the code it carries); without dependencies, from DIR only."""
    manifest = json.loads((wheels / MANIFEST).read_text())
    here = ".".join(platform.python_version_tuple()[:2])
    if manifest["python"] != here:
        raise SystemExit(f"--wheels {wheels}: prepared for Python {manifest['python']}, this is Python {here}: "
                         f"prepare again with --python {here}")
    chosen = []
    for row in manifest["wheels"]:
        try:
            have = metadata.version(row["name"])
        except metadata.PackageNotFoundError:
            have = None
        if have != row["version"] or row["name"] == "bagualu-plugin":
            chosen.append(str(wheels / row["file"]))
    if chosen:
        _pip("install", "--no-index", "--no-deps", "--quiet", "--target", str(site), "--upgrade", *chosen)
    return [Path(w).name for w in chosen]


ENVIRONMENT = r"""
import importlib.metadata as md, json
from packaging.requirements import Requirement
import torch
names = %r
found, unmet = {"torch": [torch.__version__, torch.__file__]}, []
for name in names:
    try:
        found[name] = [md.version(name), str(md.distribution(name).locate_file(""))]
    except md.PackageNotFoundError:
        unmet.append(f"{name}: not installed")
        continue
    for text in md.requires(name) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{name} needs {req}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{name} needs {req}: {have} is installed")
print(json.dumps({"found": found, "unmet": unmet, "cuda": torch.cuda.is_available()}))
"""


def environment(env: dict) -> dict:
    """The versions the parts will import (and from where), and every requirement of `CHECKED`
    that they do not meet."""
    done = subprocess.run([sys.executable, "-c", ENVIRONMENT % (CHECKED,)], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"the suite's environment does not import:\n{done.stderr.strip()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_part(part: Part, log: Path) -> None:
    """`part` in its own process group, its output to the console and `log`, killed at its budget."""
    began = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, *part.argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=part.env,
                                cwd=ROOT, start_new_session=True)
        expired = threading.Event()

        def expire():
            expired.set()
            os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(part.budget_s, expire)
        timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sink.write(line)
                if line.strip():
                    part.last_line = line.strip()
            proc.wait()
        finally:
            timer.cancel()
    part.seconds, part.returncode = time.perf_counter() - began, proc.returncode
    if expired.is_set():
        part.status = f"TIMEOUT after {part.budget_s:.0f} s"
    else:
        part.status = "PASS" if proc.returncode == 0 else f"FAIL (exit {proc.returncode})"


def parts(out: Path, env: dict, cpu: bool, budget_s: float) -> list[Part]:
    """The suite's parts and their budgets: what is left of `budget_s` goes to the payoff, whose
    own tables' budgets get that less its set-up (`SETUP_S`)."""
    check, quick = [str(HERE / "gpu_check.py")], ["--cpu", "--quick"] if cpu else []
    checks_s, trainer_s = (0.25 * budget_s, 0.2 * budget_s)
    payoff_s = budget_s - checks_s - trainer_s
    setup_s = 0.35 * payoff_s  # the payoff's warm-up training, calibration, profile and time-error part
    return [
        Part("checks", [*check, *quick, "--skip", "HF Trainer"], checks_s, {**env, "OUT": str(out / "checks")}),
        Part("trainer", [*check, *quick, "--only", "HF Trainer"], trainer_s, {**env, "OUT": str(out / "trainer")}),
        Part("payoff", [str(HERE / "gpu_payoff.py"), *(["--cpu"] if cpu else []), "--json", str(out / "payoff.json"),
                        "--png", str(out / "payoff-timeline.png"), "--budget", f"{payoff_s - setup_s:.0f}"], payoff_s, env),
    ]


def summary(suite: list[Part], out: Path) -> str:
    rows = [[p.name, p.status, f"{p.seconds:.0f}", p.last_line[:110]] for p in suite]
    payoff = out / "payoff.json"
    if payoff.exists():
        policies = {r["policy"]: r for r in json.loads(payoff.read_text())["payoff"]["policies"]}
        rows += [[f"  {name}", f"{r['ooms']} OOMs", "", f"{r['tokens_per_s']:.0f} tokens/s, {r['vs_oracle']:.2f}x the oracle, "
                  f"{r['vs_unbounded']:.2f}x unbounded, activation peak {r['peak_device_bytes'] / 2**20:.1f} MiB"]
                 for name, r in policies.items()]
    width = [max(len(str(r[i])) for r in [["part", "status", "s", "last line / figures"], *rows]) for i in range(4)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, width)) for r in [["part", "status", "s", "last line / figures"], *rows]]
    return "\n".join([lines[0], "  ".join("-" * w for w in width), *lines[1:]])


def run(args) -> int:
    began = time.perf_counter()
    out, wheels = Path(args.out), Path(args.wheels)
    out.mkdir(parents=True, exist_ok=True)
    site = out / "site"
    shutil.rmtree(site, ignore_errors=True)
    installed = install(wheels, site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    found = environment(env)
    print("installed into", site, ":", ", ".join(installed) or "nothing")
    for name, (version, where) in found["found"].items():
        print(f"  {name} {version} ({where})")
    report = {"device": "cuda" if found["cuda"] and not args.cpu else "cpu", "installed": installed, "environment": found,
              "date": time.strftime("%Y-%m-%d"), "parts": []}
    if found["unmet"]:
        print("requirements not met:\n  " + "\n  ".join(found["unmet"]))
    if not found["cuda"] and not args.cpu:
        raise SystemExit("--wheels: torch sees no CUDA device here; --cpu runs the suite small on the CPU")
    suite = parts(out, env, args.cpu, args.budget - (time.perf_counter() - began))
    for part in suite:
        print(f"\n== {part.name} (budget {part.budget_s:.0f} s)", flush=True)
        run_part(part, out / f"{part.name}.log")
    report["parts"] = [asdict(p) | {"env": None} for p in suite]
    report["seconds"] = time.perf_counter() - began
    text = summary(suite, out)
    (out / "gpu_suite.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\n{text}\n\n{report['seconds']:.0f} s in all; logs, tables, JSON and the picture in {out}")
    return 0 if all(p.status == "PASS" for p in suite) and not found["unmet"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prepare", metavar="DIR", help="gather the wheels the GPU image lacks into DIR (needs the registries)")
    mode.add_argument("--wheels", metavar="DIR", help="install DIR's wheels privately and run every part (offline)")
    parser.add_argument("--out", help="with --wheels: where the logs, tables, JSON and pictures go")
    parser.add_argument("--python", default="3.12", help="with --prepare: the image's Python, major.minor (default 3.12)")
    parser.add_argument("--image", nargs="+", help=f"with --prepare: the image's requirements (default: {' '.join(IMAGE)})")
    parser.add_argument("--image-freeze", help="with --prepare: the image's `pip freeze`, in place of --image")
    parser.add_argument("--deepspeed", default="deepspeed", help="with --prepare: the DeepSpeed to build (a requirement)")
    parser.add_argument("--budget", type=float, default=540.0, help="with --wheels: seconds for every part together (default 540)")
    parser.add_argument("--cpu", action="store_true", help="with --wheels: the same parts, small, on the CPU (CI)")
    args = parser.parse_args(argv)
    if args.wheels and not args.out:
        parser.error("--wheels needs --out, where the results go")
    if args.image and args.image_freeze:
        parser.error("--image and --image-freeze: give one of them")
    if args.budget <= 0:
        parser.error(f"--budget must be > 0 seconds, got {args.budget}")
    return prepare(args) if args.prepare else run(args)


if __name__ == "__main__":
    sys.exit(main())
