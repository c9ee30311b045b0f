"""Small builders and comparisons shared by the tests."""

from __future__ import annotations

import torch

from hybridlm import HybridConfig, HybridForCausalLM

TINY = dict(
    vocab_size=61, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
    mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba2_d_state=8, mamba2_head_dim=16, mamba2_n_groups=2,
    mamba2_chunk_size=8, mamba3_d_state=8, mamba3_head_dim=16, mamba3_n_groups=2, mamba3_chunk_size=8,
    performer_num_features=12, linformer_rank=6, linformer_max_length=256, num_experts=4,
    num_experts_per_tok=2, shared_expert_intermediate_size=16,
)


def tiny_config(**overrides) -> HybridConfig:
    return HybridConfig(**{**TINY, **overrides})


def tiny_model(seed: int = 0, **overrides) -> HybridForCausalLM:
    torch.manual_seed(seed)
    return HybridForCausalLM(tiny_config(**overrides)).eval()


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |got - expected| / max |expected|``: the error relative to the scale of the result.

    An all-zero ``got`` against a non-zero ``expected`` is an error of 1; against an all-zero ``expected`` the
    error is 0 only when ``got`` is all zero too (inf otherwise). NaN anywhere gives NaN, which no bound passes.
    """
    if expected.numel() == 0:
        return 0.0
    diff = (got.double() - expected.double()).abs().max()
    scale = expected.double().abs().max()
    if scale == 0:
        return 0.0 if diff == 0 else float("inf")
    return (diff / scale).item()


def assert_close_rel(got: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5, *,
                     allow_zero_reference: bool = False) -> None:
    """``got`` within ``rel`` of ``expected`` (see :func:`relative_error`). The reference must be finite and, unless
    ``allow_zero_reference``, not all zero: matching an all-zero reference proves little about a computation."""
    assert got.shape == expected.shape, f"shapes differ: {tuple(got.shape)} vs {tuple(expected.shape)}"
    assert bool(torch.isfinite(expected).all()), "the reference is not finite"
    if not allow_zero_reference:
        assert expected.numel() and bool(expected.ne(0).any()), \
            "the reference is all zero: the comparison would prove nothing (allow_zero_reference=True if meant)"
    err = relative_error(got, expected)
    assert err <= rel, f"relative error {err:.3g} > {rel}"


def random_ids(batch: int, length: int, vocab: int = TINY["vocab_size"], seed: int = 0, low: int = 1) -> torch.Tensor:
    return torch.randint(low, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def on_one_and_two_threads(compute):
    """``(compute() at 1 torch thread, compute() at 2)``, the thread count restored after: for kernels whose threads
    must give the same bits."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = compute()
        torch.set_num_threads(2)
        return one, compute()
    finally:
        torch.set_num_threads(threads)
