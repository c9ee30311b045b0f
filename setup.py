"""The one thing pyproject.toml cannot say: the CUDA sources live in the top-level ``kernels/`` folder (as
mamba-ssm's and vLLM's ``csrc/``) but ship inside the package, as ``hybridlm/_kernels`` (package data read by
``hybridlm/ops/cuda.py``), so that an installed wheel can build them. ``packages.find`` cannot be combined with a
folder mapped from outside the package; everything else is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

setup(
    packages=find_namespace_packages(include=["hybridlm", "hybridlm.*"]) + ["hybridlm._kernels"],
    package_dir={"hybridlm._kernels": "kernels"},
)
