"""The CUDA selective-scan sources compile: the kernels with nvcc for sm_80 and sm_90 (every kernel instantiated
for float, half and bfloat16), and the PyTorch binding with the host compiler against torch's headers (which the
CPU build of torch ships: the binding needs no CUDA header)."""

from __future__ import annotations

import re

import pytest

from .cuda_build import check_binding_syntax, host_compiler, nvcc, nvcc_compile

KERNELS = {f"scan_{kind}_kernel" for kind in ("forward", "backward")}
DTYPES = {"f": "float", "6__half": "half", "13__nv_bfloat16": "bfloat16"}  # mangled template arguments


@pytest.fixture(scope="module", params=["80", "90"])
def ptxas_report(request, tmp_path_factory) -> tuple[str, str]:
    if nvcc() is None:
        pytest.skip("nvcc is not installed: the CUDA sources cannot be compiled here")
    arch = request.param
    return arch, nvcc_compile(arch, tmp_path_factory.mktemp(f"sm{arch}"))


def test_every_kernel_is_instantiated_for_every_dtype(ptxas_report):
    arch, report = ptxas_report
    compiled = re.findall(r"Compiling entry function '_ZN13hybridlm_scan\d+(scan_\w+_kernel)I(\w+?)EEv\w*' "
                          rf"for 'sm_{arch}'", report)
    assert sorted((kernel, DTYPES[dtype]) for kernel, dtype in compiled) == sorted(
        (kernel, dtype) for kernel in KERNELS for dtype in DTYPES.values())
    assert "error" not in report.lower()


@pytest.mark.skipif(host_compiler() is None, reason="no host C++ compiler (g++ / c++ / $CXX)")
def test_binding_compiles_against_torch():
    check_binding_syntax()
