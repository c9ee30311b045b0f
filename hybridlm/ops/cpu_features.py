"""What this CPU can multiply natively, read once from ``torch.cpu.get_capabilities``: the projections
(:mod:`hybridlm.layers.linear`) and the attention (:mod:`hybridlm.ops.attention`) pick their bf16/fp16 paths by it.
A torch without ``get_capabilities`` (older than the one these were measured on) reports no feature: every
reduced-precision product then takes torch's own path, and bf16 decode attention the written-out one, which are
as exact and slower only on CPUs that have the features."""

from __future__ import annotations

import torch


def cpu_capabilities() -> dict:
    """torch's CPU feature flags (``{"avx512_bf16": True, "amx_bf16": False, ...}``), empty on an older torch."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    return {} if capabilities is None else capabilities()


def cpu_has_amx_bf16() -> bool:
    """AMX-BF16 tiles (Intel Sapphire Rapids and newer), which SDPA's CPU kernel uses for bf16 products; AVX-512
    BF16 alone (an AMD Zen 4) does not make it fast."""
    return bool(cpu_capabilities().get("amx_bf16", False))


def dtypes_without_cpu_products() -> frozenset[torch.dtype]:
    """The reduced-precision dtypes this CPU cannot multiply natively: bf16 without AVX-512 BF16 or AMX-BF16, fp16
    without AVX-512 FP16 or AMX-FP16."""
    has = cpu_capabilities()
    if not has:
        return frozenset()
    missing = set()
    if not (has.get("avx512_bf16") or has.get("amx_bf16")):
        missing.add(torch.bfloat16)
    if not (has.get("avx512_fp16") or has.get("amx_fp16")):
        missing.add(torch.float16)
    return frozenset(missing)
