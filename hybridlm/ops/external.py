"""Adapters from mamba-ssm, causal-conv1d, flash-attn and flash-linear-attention to our references' signatures.

Each loader imports its library (only when the backend is first used) and returns a function with the reference's
signature and results. An adapter raises :class:`~hybridlm.ops.declined.Declined`, before doing any work, for a
call its library cannot serve exactly, saying why; the default selection then tries the next backend, and a
forced selection reports the reason.
"""

from __future__ import annotations

import torch

from hybridlm.ops.declined import Declined

_HALF_TYPES = (torch.float16, torch.bfloat16)
_SCAN_TYPES = (torch.float32, *_HALF_TYPES)


def _floats(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.float()


class _FinalStateWithoutGradient(torch.autograd.Function):
    """mamba-ssm's ``selective_scan_fn`` drops the gradient of its last state; refuse it loudly instead."""

    @staticmethod
    def forward(ctx, state):
        return state.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "mamba_ssm's selective_scan_fn has no gradient for the final state; to backpropagate through it run "
            "selective_scan on another backend, e.g. HYBRIDLM_BACKEND=selective_scan=cuda (or triton)"
        )


def mamba_selective_scan():
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, *,
                       initial_state=None, chunk_size=None):
        if initial_state is not None:
            raise Declined("mamba_ssm's selective_scan_fn always starts from a zero state (no initial_state)")
        if u.dtype not in _SCAN_TYPES or A.shape[-1] > 256:
            raise Declined(f"mamba_ssm's selective scan needs fp32/fp16/bf16 u and dstate <= 256, got {u.dtype}, "
                           f"dstate={A.shape[-1]}")
        dtype = u.dtype
        y, last = selective_scan_fn(
            u, delta.to(dtype), A.float(), B.to(dtype), C.to(dtype), D=_floats(D),
            z=None if z is None else z.to(dtype), delta_bias=_floats(delta_bias), delta_softplus=delta_softplus,
            return_last_state=True,
        )
        return y, _FinalStateWithoutGradient.apply(last.float())

    return selective_scan


def mamba_state_update():
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update as update

    def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
        return update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)

    return selective_state_update


def mamba_ssd():
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, *, initial_state=None, seq_idx=None, cu_seqlens=None):
        if seq_idx is not None or cu_seqlens is not None:
            raise Declined("packed sequences: mamba_ssm takes one initial state per batch row, not per sequence")
        y, final = mamba_chunk_scan_combined(
            x, dt, A.float(), B, C, chunk_size, D=D, initial_states=initial_state, return_final_states=True
        )
        return y, final.float()

    return ssd_chunk_scan


def _check_conv(weight: torch.Tensor, activation) -> None:
    width = weight.shape[-1]
    if activation not in (None, "silu") or not 2 <= width <= 4:
        raise Declined(f"causal-conv1d supports widths 2..4 and activation None or 'silu', got {width}, "
                       f"{activation!r}")


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x [batch, channels, time]`` laid out time-major, as causal-conv1d needs for carried windows."""
    if x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0:
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def causal_conv1d_sequence():
    from causal_conv1d import causal_conv1d_fn

    def causal_conv1d(x, weight, bias=None, *, initial_state=None, activation=None):
        _check_conv(weight, activation)
        width = weight.shape[-1]
        if x.shape[1] % 8 or x.shape[-1] < width - 1:
            raise Declined(f"causal-conv1d carries windows only for channels divisible by 8 and at least width - 1 "
                           f"steps, got {x.shape[1]} channels, {x.shape[-1]} steps")
        initial = None if initial_state is None else _channels_last(initial_state.to(x.dtype))
        return causal_conv1d_fn(
            _channels_last(x), weight, bias, initial_states=initial, return_final_states=True, activation=activation
        )

    return causal_conv1d


def causal_conv1d_step():
    from causal_conv1d import causal_conv1d_update as update

    def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation=None):
        _check_conv(weight, activation)
        if conv_state.dtype != x.dtype:
            raise Declined(f"causal_conv1d_update keeps the window in x's dtype {x.dtype}, got {conv_state.dtype}")
        return update(x, conv_state, weight, bias, activation=activation)

    return causal_conv1d_update


def flash_attention():
    from flash_attn import flash_attn_func

    def attention(q, k, v, *, mask=None, causal=False, scale=None):
        if mask is not None:
            raise Declined("flash_attn takes no explicit mask")
        if q.dtype not in _HALF_TYPES or q.shape[-1] % 8 or q.shape[-1] > 256 or v.shape[-1] != q.shape[-1]:
            raise Declined(f"flash_attn needs fp16/bf16 and equal head dims, multiples of 8 up to 256; got {q.dtype}, "
                           f"q/k {q.shape[-1]}, v {v.shape[-1]}")
        if causal and q.shape[2] != k.shape[2]:
            raise Declined("causal attention with q_len != k_len: flash_attn aligns the causal mask differently")
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                              causal=causal)
        return out.transpose(1, 2)

    return attention


def fla_gated_delta_rule():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return adapt_fla_delta_rule(chunk_gated_delta_rule)


def adapt_fla_delta_rule(chunk_gated_delta_rule):
    """fla's ``chunk_gated_delta_rule(q, k, v, g, beta, scale=, initial_state=, output_final_state=, cu_seqlens=)``
    (one log gate per head, as many key as value heads, q, k and v of one half type) with the reference's
    signature. The mixers pass fp32 L2-normalised q, k: they go to fla in the values' type, as mamba-ssm's adapters
    pass B and C in the input's."""

    def gated_delta_rule(q, k, v, log_gate, beta, *, scale=None, initial_state=None, chunk_size=64,
                         cu_seqlens=None):
        if log_gate is not None and log_gate.dim() == 4:
            raise Declined("channel-wise gates (KDA): fla's KDA kernels take gates in conventions that changed "
                           "between its versions; not adapted")
        if v.dtype not in _HALF_TYPES or q.shape[-1] > 256 or v.shape[-1] > 256:
            raise Declined(f"fla's chunked delta rule needs fp16 or bf16 values (it asserts against fp32) and head "
                           f"dims <= 256, got {v.dtype}, dim_k={q.shape[-1]}, dim_v={v.shape[-1]}")
        group = v.shape[2] // q.shape[2]  # key heads shared by value heads: repeated, exactly
        q, k = (t.repeat_interleave(group, dim=2).to(v.dtype) for t in (q, k))
        gate = log_gate if log_gate is not None else beta.new_zeros(beta.shape)
        o, final = chunk_gated_delta_rule(q, k, v, gate.float(), beta, scale=scale, initial_state=initial_state,
                                          output_final_state=True, cu_seqlens=cu_seqlens)
        return o, final.float()

    return gated_delta_rule


def _mamba3_declines(q, v, angles, mimo_v, norm_weight, rope_pairs, seq_idx=None) -> None:
    """What mamba-ssm's SISO Triton kernels for Mamba-3 cannot serve exactly (they compute in bf16)."""
    dims = (q.shape[-1], v.shape[-1])
    reasons = [why for bad, why in (
        (q.shape[-3] != 1 or mimo_v is not None, "MIMO (mamba-ssm runs it with TileLang)"),
        (norm_weight is not None, "the output norm (mamba-ssm applies it outside the kernel)"),
        (rope_pairs != "interleaved", f"rope_pairs={rope_pairs!r} (its SISO kernels pair entries (2i, 2i+1))"),
        (v.dtype != torch.bfloat16, f"{v.dtype} inputs (its kernels compute in bf16)"),
        (any(d & (d - 1) for d in dims), f"head dims {dims} (powers of two only)"),
        (angles.shape[-1] % 2, f"{angles.shape[-1]} rotary angles (an even count only)"),
        (seq_idx is not None, "seq_idx (it takes cu_seqlens)"),
    ) if bad]
    if reasons:
        raise Declined("mamba_ssm's Mamba-3 kernels do not take " + "; ".join(reasons))


def mamba3_siso_scan():
    from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined

    from hybridlm.ops.mamba3 import Mamba3Carry

    def mamba3_scan(q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, *, D=None, z=None, mimo_v=None,
                    mimo_z=None, mimo_o=None, norm_weight=None, norm_eps=1e-5, rope_pairs="interleaved",
                    initial_state=None, chunk_size=64, seq_idx=None, cu_seqlens=None):
        _mamba3_declines(q, v, angles, mimo_v, norm_weight, rope_pairs, seq_idx)
        states = None if initial_state is None else (initial_state.angle, initial_state.ssm, initial_state.k[:, 0],
                                                     initial_state.v)  # the map in hybridlm.ops.mamba3's docstring
        y, angle, ssm, last_k, last_v = mamba3_siso_combined(
            q[:, :, 0], k[:, :, 0], v, log_decay.transpose(1, 2).float(), dt.transpose(1, 2).float(),
            trap.transpose(1, 2), q_bias[:, 0].float(), k_bias[:, 0].float(), angles, D=_floats(D), Z=z,
            Input_States=states, chunk_size=chunk_size, return_final_states=True,
            cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.int32))
        return y, Mamba3Carry(angle.float(), ssm.float(), last_k.unsqueeze(1).to(q.dtype), last_v.to(v.dtype))

    return mamba3_scan


def mamba3_siso_step():
    from mamba_ssm.ops.triton.mamba3.mamba3_siso_step import mamba3_siso_step as step

    def mamba3_step(q, k, v, log_decay, dt, trap, angles, q_bias, k_bias, angle_state, ssm_state, k_state, v_state,
                    *, D=None, z=None, mimo_v=None, mimo_z=None, mimo_o=None, norm_weight=None, norm_eps=1e-5,
                    rope_pairs="interleaved"):
        _mamba3_declines(q, v, angles, mimo_v, norm_weight, rope_pairs)
        y, (angle, ssm, last_k, last_v) = step(
            q[:, 0], k[:, 0], v, log_decay.float(), dt.float(), trap, q_bias[:, 0].float(), k_bias[:, 0].float(),
            angles, D=_floats(D), Z=z, Input_States=(angle_state, ssm_state, k_state[:, 0], v_state))
        for state, new in ((angle_state, angle), (ssm_state, ssm), (k_state[:, 0], last_k), (v_state, last_v)):
            state.copy_(new)
        return y

    return mamba3_step


# (backend, op) -> loader returning the adapted function.
LOADERS = {
    ("mamba_ssm", "selective_scan"): mamba_selective_scan,
    ("mamba_ssm", "selective_state_update"): mamba_state_update,
    ("mamba_ssm", "ssd_chunk_scan"): mamba_ssd,
    ("mamba_ssm", "mamba3_scan"): mamba3_siso_scan,
    ("mamba_ssm", "mamba3_step"): mamba3_siso_step,
    ("causal_conv1d", "causal_conv1d"): causal_conv1d_sequence,
    ("causal_conv1d", "causal_conv1d_update"): causal_conv1d_step,
    ("flash_attn", "attention"): flash_attention,
    ("fla", "gated_delta_rule"): fla_gated_delta_rule,
}
