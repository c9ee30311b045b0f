"""Quantized recurrent states (``CachePolicy(state_bits=8 | "fp8", state_rounding=...)``).

A recurrent state class names the tensors a policy quantizes in its ``quantized_fields``
(:class:`~hybridlm.cache.states.Quantizable`): an SSM's state and conv window, Performer's and Linformer's
running sums, a short-conv window, Mamba-3's state and previous input. Each is held as codes with fp32 scales:
the absmax over 127 (int8) or 448 (fp8 e4m3) of each group that ``scale_dims`` names (a head for an SSM state or
a running sum; a held token's column for a conv window). The class's other tensors stay as they were (Performer's
running maximum, Linformer's token count, Mamba-3's angles). :func:`quantized_class` derives the quantized form
of any such class; a kind needs nothing else.

The seam is the one every recurrent mixer already goes through. :meth:`checkpointing` (called at the start of
each forward, before the mixer reads its state) dequantizes the codes into a working tensor under the field's own
name and dtype, which the mixer reads and updates as it would a plain state; the forward's result is quantized
back when the forward is done (:meth:`keep_states`, :meth:`advance` or any read of the stored tensors) and the
working tensor is dropped. So each forward computes from the dequantized state and writes its final state
quantized; a one-token decode step quantizes after every token. A multi-token forward quantizes once, at its end:
outputs depend on how a prefill is cut into forwards (``chunk_dependent``), except that a verification block (2 to
64 tokens on a warm state) reaches the state one token at a time (:meth:`QuantizedState.one_token_at_a_time`), as
the decode steps it stands for. Mixers never read the codes.

Rounding (``rounding``), of the fields that accumulate (``Quantizable.accumulates``):

* ``nearest``: round to the nearest code;
* ``stochastic``: round up with probability equal to the fraction (fp8: dither by one unit in the last place,
  then round to nearest); the noise is a function of ``seed`` and the number of tokens the state has seen, the
  same for every row, so a run, a crop and a prefix-cache restore are reproducible bit for bit;
* ``feedback``: the rounding error of each write (``value - dequantized``) is kept in a bf16 ``residual`` of the
  field's shape and added to the next write (error feedback); its bytes are counted.

A field that does not accumulate (a window of recent inputs, each entry written once) rounds to nearest under
every mode: nothing sums its errors, and rounding an entry again to its own scale gives the same code, so a
window's old columns do not change as it shifts. ``CachePolicy(state_windows=False)`` keeps such fields as they
are.

Bytes per row and quantized field of ``n`` entries in ``g`` scale groups: ``n + 4 * g`` (``+ 2 * n`` with
feedback, on a field that accumulates); see :meth:`QuantizedState.predicted_nbytes`. Rollback checkpoints hold
the same quantized form.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from hybridlm.cache import rollback
from hybridlm.cache.states import (
    CompressedKVState,
    LinearAttentionState,
    RecurrentState,
    SSMState,
    _tensor_nbytes,
)

STATE_BITS = (8, "fp8")
ROUNDINGS = ("nearest", "stochastic", "feedback")
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def fp8_dtype(device=None) -> torch.dtype:
    """torch's float8 e4m3 dtype, checked to cast on ``device``; ValueError naming ``state_bits`` otherwise."""
    return _fp8_dtype(str(torch.device(device if device is not None else "cpu")))


@functools.cache
def _fp8_dtype(device: str) -> torch.dtype:
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        raise ValueError(f'CachePolicy.state_bits="fp8": this torch ({torch.__version__}) has no float8 dtypes; '
                         "use state_bits=8")
    try:
        torch.ones(2, device=device).to(dtype).float()
    except (RuntimeError, TypeError) as error:
        raise ValueError(f'CachePolicy.state_bits="fp8": float8 e4m3 is not supported on device {device} '
                         f"({error}); use state_bits=8") from error
    return dtype


def _noise(shape: tuple[int, ...], seed: int, step: int, device) -> torch.Tensor:
    """Uniform [0, 1) noise ``[1, *shape[1:]]`` that depends only on ``seed`` and ``step`` (shared by all rows)."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
    return torch.rand((1, *shape[1:]), generator=generator).to(device)


def quantize(value: torch.Tensor, scale_dims: tuple[int, ...], bits, rounding: str, seed: int, step: int):
    """``value [batch, ...]`` (fp32) as ``(codes, scales)``: one scale per batch row and index of
    ``scale_dims``, kept as dims of size 1 elsewhere so that ``codes * scales`` broadcasts (see the module
    docstring); ``step`` (the tokens seen after this write) chooses the stochastic noise."""
    top = 127.0 if bits == 8 else _FP8_MAX
    reduced = [d for d in range(1, value.dim()) if d not in scale_dims]
    absmax = value.abs().amax(dim=reduced, keepdim=True) if reduced else value.abs()
    scales = torch.where(absmax > 0, absmax / top, torch.ones_like(absmax))
    scaled = value / scales
    if bits == 8:
        if rounding == "stochastic":
            scaled = torch.floor(scaled + _noise(value.shape, seed, step, value.device))
        else:
            scaled = torch.round(scaled)
        return scaled.clamp_(-127, 127).to(torch.int8), scales
    if rounding == "stochastic":  # one unit in the last place of e4m3 (3 mantissa bits; subnormals 2**-9)
        ulp = torch.exp2(torch.floor(torch.log2(scaled.abs().clamp(min=2.0**-6))) - 3)
        scaled = scaled + (_noise(value.shape, seed, step, value.device) - 0.5) * ulp
    return scaled.clamp_(-_FP8_MAX, _FP8_MAX).to(fp8_dtype(value.device)), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales


@dataclasses.dataclass
class QuantizedState(RecurrentState):
    """A recurrent state whose ``quantized_fields`` are held as ``<name>_codes``, ``<name>_scales`` and (feedback)
    ``<name>_residual``; the field ``<name>`` itself is None except during a forward, when it holds the working
    value (in the dtype the plain state had: ``working_dtypes``). :func:`quantized_class` makes the
    subclass of each plain state class, with those fields."""

    chunk_dependent = True

    bits: int | str = dataclasses.field(default=8, kw_only=True)
    rounding: str = dataclasses.field(default="nearest", kw_only=True)
    seed: int = dataclasses.field(default=0, kw_only=True)
    steps: int = dataclasses.field(default=0, kw_only=True)  # tokens the state has seen (the stochastic noise's step)
    pending: int = dataclasses.field(default=0, kw_only=True)  # tokens of the forward whose result is not yet stored
    #: the dtype of each quantized field in the plain state (``torch`` attribute names, in field order)
    working_dtypes: list = dataclasses.field(default_factory=list, kw_only=True)

    @classmethod
    def of(cls, state: RecurrentState, bits, rounding: str, seed: int = 0) -> QuantizedState:
        """The quantized form of ``state`` (an empty or a warm one; its rollback history is not carried over)."""
        plain = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "history"}
        stored, dtypes = {}, []
        for name, spec in cls.quantized_fields.items():
            value = plain.pop(name)
            dtypes.append(str(value.dtype).removeprefix("torch."))
            codes, scales = quantize(value.float(), spec.scale_dims, bits, "nearest", seed, 0)
            stored.update({f"{name}_codes": codes, f"{name}_scales": scales})
            stored[f"{name}_residual"] = torch.zeros_like(codes, dtype=torch.bfloat16) \
                if rounding == "feedback" and spec.accumulates else None
        return cls(**plain, **dict.fromkeys(cls.quantized_fields), **stored, bits=bits, rounding=rounding, seed=seed,
                   working_dtypes=dtypes)

    # --- the working value ------------------------------------------------------------------------

    def _store(self, values: dict[str, torch.Tensor], step: int, residuals: dict | None = None) -> dict:
        """``values`` (``[batch, ...]``, or ``[batch, time, ...]`` with per-token ``step``) in stored form."""
        out = {}
        for name, value in values.items():
            spec, value = self.quantized_fields[name], value.float()
            rounding = self.rounding if spec.accumulates else "nearest"
            residual = (residuals or {}).get(name, getattr(self, f"{name}_residual"))
            if residual is not None:
                value = value + (residual.float() if value.dim() == residual.dim() else residual.float().unsqueeze(1))
            if value.dim() == getattr(self, f"{name}_codes").dim():
                codes, scales = quantize(value, spec.scale_dims, self.bits, rounding, self.seed, step)
            else:  # per-token states [batch, time, ...]: token j is written at step + j
                pairs = [quantize(value[:, j], spec.scale_dims, self.bits, rounding, self.seed, step + j)
                         for j in range(value.shape[1])]
                codes, scales = (torch.stack(parts, 1) for parts in zip(*pairs))
            out[f"{name}_codes"], out[f"{name}_scales"] = codes, scales
            if residual is not None:
                out[f"{name}_residual"] = (value - dequantize(codes, scales)).to(torch.bfloat16)
        return out

    def _commit(self) -> None:
        """Quantize the working values of the forward just run into the stored tensors; drop them."""
        if not self.pending:
            return
        self.steps += self.pending
        stored = self._store({name: getattr(self, name) for name in self.quantized_fields}, self.steps)
        for key, value in stored.items():
            getattr(self, key).copy_(value)
        for name in self.quantized_fields:
            setattr(self, name, None)
        self.pending = 0

    def checkpointing(self, time: int) -> bool:
        self._commit()
        keep = rollback.start_forward(self, time)  # (its history holds the stored form)
        for name, dtype in zip(self.quantized_fields, self.working_dtypes, strict=True):
            value = dequantize(getattr(self, f"{name}_codes"), getattr(self, f"{name}_scales"))
            setattr(self, name, value.to(getattr(torch, dtype)))
        self.pending = time
        return keep

    def keep_states(self, **per_token: torch.Tensor) -> None:
        before = self.steps
        residuals = {name: r.clone() for name in self.quantized_fields
                     if (r := getattr(self, f"{name}_residual")) is not None}  # as they were before this forward
        self._commit()
        if any(t is not None for t in per_token.values()):
            quantized = {name: per_token.pop(name) for name in self.quantized_fields}
            per_token.update(self._store(quantized, before + 1, residuals))
        rollback.keep_states(self, per_token)

    def advance(self, tokens: int) -> None:
        self._commit()
        super().advance(tokens)

    def one_token_at_a_time(self, time: int) -> bool:
        """A verification block (2 to ``AUTO_CHECKPOINT_TOKENS`` tokens on a warm state, what speculative decoding
        sends): one-token forwards, so that each token reads the state as its decode step would, quantized after
        the token before, and each kept checkpoint is what that step stores."""
        return self.warm and 1 < time <= rollback.AUTO_CHECKPOINT_TOKENS

    def rewind(self, tokens: int) -> None:
        self._commit()
        super().rewind(tokens)
        self.steps -= tokens

    # --- the state interface on the stored form ----------------------------------------------------

    def _tensors(self) -> dict[str, torch.Tensor]:
        self._commit()
        return super()._tensors()

    @property
    def fixed_step(self) -> bool:
        return False  # the working value comes and goes outside the mixer: no compiled decode step

    def predicted_nbytes(self, tokens: int = 0) -> int:
        """Bytes held, whatever ``tokens``: the unquantized tensors, then per quantized field of ``n`` entries
        and ``g`` scale groups (the batch rows times the sizes of its ``scale_dims``): ``n`` (int8 or fp8 codes)
        + ``4 g`` (fp32 scales) + ``2 n`` with feedback on a field that accumulates (the bf16 residual)."""
        total = 0
        for name, t in self._tensors().items():
            if not name.endswith(("_codes", "_scales", "_residual")):
                total += _tensor_nbytes(t)
        for name, spec in self.quantized_fields.items():
            codes = getattr(self, f"{name}_codes")
            n, groups = codes.numel(), codes.shape[0] * math.prod(codes.shape[d] for d in spec.scale_dims)
            total += n + 4 * groups + (2 * n if self.rounding == "feedback" and spec.accumulates else 0)
        return total


@functools.cache
def quantized_class(cls: type[RecurrentState], windows: bool = True) -> type[QuantizedState]:
    """``Quantized<cls>``: ``cls`` with each of its ``quantized_fields`` (without ``windows``: those that
    accumulate) held as codes, scales and a residual."""
    fields = {name: spec for name, spec in cls.quantized_fields.items() if windows or spec.accumulates}
    stored = [(f"{name}_{part}", torch.Tensor | None, dataclasses.field(default=None, kw_only=True))
              for name in fields for part in ("codes", "scales", "residual")]
    doc = f":class:`{cls.__name__}` with {', '.join(fields)} quantized (:mod:`hybridlm.cache.quantized_state`)."
    return dataclasses.make_dataclass(f"Quantized{cls.__name__}", stored, bases=(QuantizedState, cls),
                                      namespace={"__doc__": doc, "__module__": __name__, "quantized_fields": fields})


QuantizedSSMState = quantized_class(SSMState)
QuantizedLinearAttentionState = quantized_class(LinearAttentionState)
QuantizedCompressedKVState = quantized_class(CompressedKVState)


def quantized(state: RecurrentState, bits, rounding: str, seed: int = 0, windows: bool = True) -> RecurrentState | None:
    """The quantized form of ``state`` (None: no field of its class is quantized, with or without ``windows``)."""
    cls = quantized_class(type(state), windows)
    return cls.of(state, bits, rounding, seed) if cls.quantized_fields else None
