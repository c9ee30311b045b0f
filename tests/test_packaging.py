"""Packaging: the declared torch floor covers every version-gated torch API the package uses, and a wheel
carries the CUDA sources that ``hybridlm.ops.cuda`` builds from.

The floor is checked against this table rather than by running the suite on the oldest torch: installing a
second torch and running the suite on it does not fit the CI budget (2 cores, 10 minutes) and needs the network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridlm"

#: Version-gated torch APIs: a regular expression that finds a use in hybridlm's sources, and the first torch
#: release that has it. Add a row when code starts using a newer API.
GATED_TORCH_APIS = {
    "scaled_dot_product_attention(enable_gqa=)": (r"\benable_gqa\s*=", (2, 5)),
    "torch.nn.attention.flex_attention": (r"flex_attention", (2, 5)),
    "torch.distributed.fsdp.fully_shard (FSDP2, public path)": (r"from torch\.distributed\.fsdp import .*fully_shard",
                                                               (2, 6)),
    "torch.accelerator": (r"torch\.accelerator\b", (2, 6)),
    "torch.library.custom_op / register_fake": (r"torch\.library\.(custom_op|register_fake)", (2, 4)),
    "torch.nn.functional.rms_norm": (r"\b(F|functional)\.rms_norm\(", (2, 4)),
    "torch.nn.attention.sdpa_kernel": (r"\bsdpa_kernel\b", (2, 3)),
    "torch.uint16 / uint32 / uint64": (r"torch\.uint(16|32|64)\b", (2, 3)),
}
#: transformers' own floor: transformers 5 declares torch>=2.6 for its models.
TRANSFORMERS_TORCH_FLOOR = (2, 6)


def declared_torch_floor() -> tuple[int, int]:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"torch>=(\d+)\.(\d+)[^"]*"', text)
    assert match, "pyproject.toml declares no torch>= floor"
    return int(match[1]), int(match[2])


def sources() -> str:
    return "\n".join(file.read_text() for file in sorted(PACKAGE.rglob("*.py")))


def test_torch_floor_covers_every_version_gated_api_in_use():
    floor, code = declared_torch_floor(), sources()
    used = {name: version for name, (pattern, version) in GATED_TORCH_APIS.items() if re.search(pattern, code)}
    assert "scaled_dot_product_attention(enable_gqa=)" in used  # the table finds what the code uses
    needed = max([*used.values(), TRANSFORMERS_TORCH_FLOOR])
    assert floor >= needed, f"torch>={floor[0]}.{floor[1]} but {used} need {needed}"
    assert floor == needed, f"torch>={floor[0]}.{floor[1]} is above what the code needs ({needed}): lower it or " \
                            "add the API that needs it to GATED_TORCH_APIS"


def test_wheel_carries_the_kernel_sources_and_build_kernels_finds_them(tmp_path):
    """kernels/ (CUDA and CPU sources) ships in the wheel as hybridlm/_kernels, and an installed wheel (not the
    source tree) finds it."""
    pytest.importorskip("setuptools")
    from hybridlm.ops.cuda import KERNEL_DIR, SOURCES

    assert KERNEL_DIR == ROOT / "kernels" / "selective_scan"  # here: the source tree
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("hybridlm", "kernels"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source),
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "wheel").glob("hybridlm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"hybridlm/_kernels/{file.relative_to(ROOT / 'kernels').as_posix()}"
                for file in (ROOT / "kernels").rglob("*") if file.is_file()}
    assert {f"hybridlm/_kernels/selective_scan/{name}" for name in SOURCES} <= expected
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    assert not any(name.startswith("kernels/") for name in names), "kernels/ must not be a top-level package"

    installed = tmp_path / "installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(installed), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    import torch

    check = ("from hybridlm.ops.cpu_kernels import SOURCE_DIR, SOURCES; "
             "print('CPU sources:', SOURCE_DIR, all((SOURCE_DIR / name).is_file() for name in SOURCES)); "
             + ("from hybridlm.cli import main; main(['build-kernels'])" if torch.version.cuda is None else
                "from hybridlm.ops.cuda import KERNEL_DIR; print('CUDA sources:', KERNEL_DIR)"))  # no minute-long build
    run = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(installed)})
    found = f"CUDA sources: {installed / 'hybridlm' / '_kernels' / 'selective_scan'}"
    assert found in run.stdout, run.stdout + run.stderr
    assert f"CPU sources: {installed / 'hybridlm' / '_kernels' / 'cpu'} True" in run.stdout, run.stdout
    if torch.version.cuda is None:
        assert run.returncode == 2 and "this torch build has no CUDA" in run.stderr, run.stderr


def test_kernels_is_not_an_importable_package():
    """transformers probes for a package named ``kernels``: the folder must not pass for it from the repo root."""
    import importlib.metadata

    assert not (ROOT / "kernels" / "__init__.py").exists()
    try:
        importlib.metadata.version("kernels")
        pytest.skip("the real kernels package is installed here")
    except importlib.metadata.PackageNotFoundError:
        pass
    run = subprocess.run([sys.executable, "-c", "from transformers.utils import is_kernels_available as k; print(k())"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "False", run.stdout + run.stderr
