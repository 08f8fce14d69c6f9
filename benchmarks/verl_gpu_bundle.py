"""Build the bundle that `benchmarks/verl_gpu_run.sh` needs on a GPU machine without network or pip index.

The GPU machine (see the device README) has Python 3.12, torch, transformers, tokenizers, numpy, pandas,
pyarrow, aiohttp, grpcio, tensorboard, tiktoken... but not verl, Ray or agentrl's own dependencies. This
script, run on a machine with PyPI access, writes to ``OUT_DIR``:

- ``site.tar.xz``: one site folder holding every missing distribution for CPython 3.12 on manylinux
  x86-64, unpacked from its wheel (pinned below: the versions verl's whole ``main_ppo`` was rehearsed
  with on the CPU, ``tests/test_verl_main_ppo_cpu.py``), plus agentrl itself as a wheel built from this
  checkout's tracked files (so the ``verl.plugins`` entry point that loads our plugin in every verl process is there).
  Wheels are unpacked into one folder, not ``pip install --target``ed one by one (distributions sharing
  a top-level folder, e.g. ``google/`` or ``opentelemetry/``, would replace each other). Ray's Java jar
  (``ray/jars``, 31 MiB, only for Java workers) is left out so that the bundle fits one call.
- ``site.tar.xz.part-aa``, ``-ab``, ...: the same archive split, only when it is larger than
  ``--max-part-mib`` (then carry the parts in separate calls, as ``../shared/FACTS.md`` describes);
- ``run/``: ``verl_gpu_run.sh``, ``verl_step1_compare.py``, ``verl_run_report.py`` from this checkout;
- ``MANIFEST.txt``: the wheels, their sizes and sha256, and the archive's sha256.

Usage: python benchmarks/verl_gpu_bundle.py OUT_DIR [--python-version 3.12] [--max-part-mib 60]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Distributions the GPU image lacks, on the import path of verl's main_ppo with agentrl's plugin, rollout,
# agent loop and retool env (traced with an import hook in every process of a CPU run), pinned to the
# versions that run used. Ray's [default] extras are included: its dashboard/metrics agent imports them.
WHEELS = [
    "ray==2.60.0", "verl==0.9.1", "transferqueue==0.1.11", "tensordict==0.10.0", "pyvers==0.1.0",
    "torchdata==0.11.0", "hydra-core==1.3.8", "omegaconf==2.3.1", "codetiming==1.4.0", "datasets==5.2.0",
    "dill==0.4.1", "multiprocess==0.70.19", "msgspec==0.23.0", "pyzmq==27.3.0", "orjson==3.13.0",
    "cachetools==8.0.2", "nvtx==0.2.17", "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0",
    "sniffio==1.3.1", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
    "typing-inspection==0.4.5", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0", "rpds-py==2026.9.1", "aiohttp-cors==0.8.1", "colorful==0.5.8",
    "opencensus==0.11.4", "opencensus-context==0.1.3", "google-api-core==2.44.0", "google-auth==2.63.0",
    "googleapis-common-protos==1.76.0", "protobuf==7.36.2", "opentelemetry-api==1.45.2",
    "opentelemetry-sdk==1.45.2", "opentelemetry-proto==1.45.2", "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-exporter-prometheus==0.66b2", "opentelemetry-exporter-otlp-proto-common==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2", "opentelemetry-exporter-otlp-common==0.66b2",
    "opentelemetry-exporter-http-transport==0.66b2", "h2==4.4.1", "hpack==4.2.0", "hyperframe==6.1.0",
    "gymnasium==1.4.0", "farama-notifications==0.0.6", "openai-harmony==0.0.8", "quicktok-v1==0.4.0",
    "math-verify==0.9.0", "latex2sympy2-extended==1.11.0",
]
# Only published as source distributions: built into (pure-Python) wheels here.
SDISTS = ["antlr4-python3-runtime==4.9.3", "pylatexenc==2.11"]
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
SKIP = ("ray/jars/",)
SCRIPTS = ["benchmarks/verl_gpu_run.sh", "benchmarks/verl_step1_compare.py", "benchmarks/verl_run_report.py"]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(wheels: Path, python_version: str) -> None:
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
        "--implementation", "cp", *plat, "-d", str(wheels), *WHEELS)
    sdists = wheels.parent / "sdist"
    pip("download", "-q", "--no-deps", "--no-binary=:all:", "-d", str(sdists), *SDISTS)
    pip("wheel", "-q", "--no-deps", "-w", str(wheels), *map(str, sorted(sdists.iterdir())))
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(tracked_copy(wheels.parent / "src")))


def tracked_copy(dest: Path) -> Path:
    """The checkout's git-tracked files (as they are on disk) copied to ``dest``: agentrl's wheel is built
    from these alone, never from stale ``build/`` leftovers or untracked files of the checkout."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def unpack(wheels: Path, site: Path) -> list[str]:
    """Unpack every wheel into ``site`` (``*.data/purelib|platlib`` to the top, scripts dropped)."""
    names = []
    for whl in sorted(wheels.glob("*.whl")):
        names.append(whl.name)
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                name = info.filename
                if name.endswith("/") or name.startswith(SKIP):
                    continue
                parts = name.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts/headers/data: not needed on PYTHONPATH
                    parts = parts[2:]
                target = site.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(target, mode)
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--max-part-mib", type=float, default=60.0)
    args = ap.parse_args(argv)
    out: Path = args.out
    work = out / ".build"
    shutil.rmtree(work, ignore_errors=True)
    wheels, site = work / "wheels", work / "site"
    wheels.mkdir(parents=True)
    download(wheels, args.python_version)
    names = unpack(wheels, site)
    archive = out / "site.tar.xz"
    for old in out.glob("site.tar.xz*"):
        old.unlink()
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for path in sorted(site.iterdir()):
            tar.add(path, arcname=path.name)
    size = archive.stat().st_size
    manifest = [f"{whl.name} {whl.stat().st_size} {sha256(whl)}" for whl in sorted(wheels.glob('*.whl'))]
    manifest.append(f"site.tar.xz {size} {sha256(archive)}")
    limit = int(args.max_part_mib * 2**20)
    if size > limit:
        with open(archive, "rb") as f:
            for i, chunk in enumerate(iter(lambda: f.read(limit), b"")):
                part = out / f"site.tar.xz.part-a{chr(ord('a') + i)}"
                part.write_bytes(chunk)
                manifest.append(f"{part.name} {len(chunk)} {sha256(part)}")
        archive.unlink()
    run = out / "run"
    run.mkdir(exist_ok=True)
    for script in SCRIPTS:
        shutil.copy2(REPO / script, run / Path(script).name)
    (out / "MANIFEST.txt").write_text("\n".join(manifest) + "\n")
    shutil.rmtree(work)
    print(f"bundle: {out} ({len(names)} wheels, site.tar.xz {size / 2**20:.1f} MiB"
          f"{', split' if size > limit else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
