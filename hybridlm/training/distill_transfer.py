"""Stage 1 of a distillation, attention transfer: each new mixer of the student learns to give its attention
layer's output on the teacher's own hidden states (LoLCATs' first stage).

One teacher forward, without gradients, records every replaced layer's mixer input (the normalised hidden state)
and its attention's output; the forward stops after the last replaced layer (the layers above and the LM head
are not run). Each new mixer then runs on its layer's recorded input, and all of them train at once on

    error = |mixer(x) - attention(x)|^2 / |attention(x)|^2      (per token: 1 is a zero output, 0 exact)

averaged over the layers and summed over the tokens; gradients reach the new mixers only, never through the
stack. :class:`AttentionTransfer` is the module the training loop trains: its parameters are the new mixers
(so its checkpoints and optimizer hold nothing else), and it computes the student's logits when asked as a
causal LM would be (``forward`` without ``transfer``), so the loop's held-out evaluation is the student's.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.mixers.segments import mix

_EPS = 1e-6  # added to |attention(x)|^2


class _Done(Exception):
    """Raised by the hook of the last recorded layer: the teacher's forward has given all it needs."""


class AttentionTransfer(nn.Module):
    """The new mixers of ``student`` (at ``layers``), trained to reproduce ``teacher``'s attention there.

    ``student`` and ``teacher`` are held, not registered: ``parameters()``, ``state_dict()`` and what data
    parallelism wraps or shards are the new mixers alone (``shard_units``: one unit per mixer)."""

    def __init__(self, student, teacher, layers: list[int]):
        super().__init__()
        self.layers = list(layers)
        self.mixers = nn.ModuleList(student.model.layers[i].mixer for i in self.layers)
        self.config = student.config
        self.__dict__["student"], self.__dict__["teacher"] = student, teacher  # not submodules

    def shard_units(self):
        return list(self.mixers)

    def after_optimizer_step(self) -> None:
        for mixer in self.mixers:
            if hasattr(mixer, "after_optimizer_step"):
                mixer.after_optimizer_step()

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        """Nothing to recompute: each mixer's activations are its own (the stack is not run with gradients)."""

    def forward(self, input_ids, position_ids=None, *, transfer: bool = False, weights=None, **kwargs):
        """The student's causal-LM output; with ``transfer``: the per-layer errors summed over the tokens,
        ``[len(layers)]``, each token weighted by ``weights [batch, time]`` (default 1)."""
        if not transfer:
            return self.student(input_ids=input_ids, position_ids=position_ids, **kwargs)
        recorded = self.teacher_io(input_ids, position_ids)
        errors = []
        for mixer, (x, positions, segments, target) in zip(self.mixers, recorded):
            out = mix(mixer, x, None, positions=positions, segments=segments)
            error = (out.float() - target.float()).square().sum(-1) / (target.float().square().sum(-1) + _EPS)
            errors.append((error if weights is None else error * weights).sum())
        return torch.stack(errors)

    @torch.no_grad()
    def teacher_io(self, input_ids, position_ids=None) -> list[tuple]:
        """``(mixer input, positions, segments, attention output)`` of each replaced layer in one teacher forward
        that stops after the last of them."""
        recorded, last = {}, max(self.layers)

        def hook(i):
            def record(module, args, kwargs, output):
                recorded[i] = (args[0], kwargs.get("positions"), kwargs.get("segments"), output)
                if i == last:
                    raise _Done

            return record

        blocks = self.teacher.model.layers
        handles = [blocks[i].mixer.register_forward_hook(hook(i), with_kwargs=True) for i in self.layers]
        try:
            self.teacher.model(input_ids=input_ids, position_ids=position_ids)
        except _Done:
            pass
        finally:
            for handle in handles:
                handle.remove()
        return [recorded[i] for i in self.layers]


@torch.no_grad()
def fit_output_scales(model: AttentionTransfer, batch: dict[str, torch.Tensor]) -> list[float]:
    """Stage 1's first move, in closed form: scale the input columns of each new mixer's ``out_proj`` by the
    per-channel factors ``s`` that minimise the training error on ``batch`` (weighted least squares, each token
    weighted by ``1 / |attention(x)|^2`` as in the error; ``s = 0`` is in reach, so the error on ``batch`` ends
    at most 1). A freshly initialised mixer's output is of no particular scale, the attention's is small: this
    fits the scale at once instead of over hundreds of steps. Returns each layer's error on ``batch`` after."""
    device = next(model.parameters()).device
    input_ids = batch["input_ids"].to(device)
    positions = batch.get("position_ids")
    positions = None if positions is None else positions.to(device)
    weights = torch.zeros_like(input_ids, dtype=torch.float64)
    weights[:, 1:] = (batch["labels"][:, 1:] != -100).double()
    errors = []
    for mixer, (x, mixer_positions, segments, target) in zip(model.mixers, model.teacher_io(input_ids, positions)):
        seen = {}
        handle = mixer.out_proj.register_forward_hook(lambda module, args, out, seen=seen: seen.update(u=args[0]))
        mix(mixer, x, None, positions=mixer_positions, segments=segments)
        handle.remove()
        u = seen["u"].flatten(0, -2).double()  # out_proj's input, per token
        t = target.flatten(0, -2).double()
        w = mixer.out_proj.weight.double()
        if mixer.out_proj.bias is not None:
            t = t - mixer.out_proj.bias.double()
        a = weights.flatten() / (target.flatten(0, -2).double().square().sum(-1) + _EPS)  # per-token weights
        gram = (w.T @ w) * ((u * a[:, None]).T @ u)  # the normal equations of |W diag(s) u - t|^2 in s
        rhs = ((u * a[:, None]) * (t @ w)).sum(0)
        ridge = 1e-6 * gram.diagonal().mean().clamp_min(1e-30)
        scales = torch.linalg.solve(gram + ridge * torch.eye(len(gram), dtype=gram.dtype, device=gram.device), rhs)
        mixer.out_proj.weight.mul_(scales.to(mixer.out_proj.weight.dtype))
    errors = model(input_ids, positions, transfer=True, weights=weights.float())
    return (errors / weights.sum()).tolist()


def transfer_losses(model, batch: dict[str, torch.Tensor], precision: str = "fp32"):
    """The training loop's ``losses`` for stage 1: the layers' mean error summed over the labelled tokens (those
    the loop counts as targets: every token but a row's first and a document's first), their count, no aux."""
    from hybridlm.training.loop import _autocast

    device = next(model.parameters()).device
    batch = {name: tensor.to(device) for name, tensor in batch.items()}
    weights = torch.zeros_like(batch["labels"], dtype=torch.float32)
    weights[:, 1:] = (batch["labels"][:, 1:] != -100).float()
    with _autocast(precision, device):
        errors = model(batch["input_ids"], batch.get("position_ids"), transfer=True, weights=weights)
    return errors.sum() / errors.numel(), int(weights.sum()), None


@torch.no_grad()
def held_out_errors(model, rows, layout: str, limit: int, batch_size: int = 8, precision: str = "fp32") -> list[float]:
    """Each replaced layer's mean error over the labelled tokens of the first ``limit`` held-out rows."""
    from hybridlm.training.loop import _autocast

    was_training = model.training
    model.eval()
    totals, count = None, 0
    for start in range(0, min(limit, len(rows)), batch_size):
        batch = rows.batch(torch.arange(start, min(start + batch_size, limit, len(rows))), layout)
        device = next(model.parameters()).device
        weights = torch.zeros_like(batch["labels"], dtype=torch.float32)
        weights[:, 1:] = (batch["labels"][:, 1:] != -100).float()
        position_ids = batch.get("position_ids")
        with _autocast(precision, device):
            errors = model(batch["input_ids"].to(device), None if position_ids is None else position_ids.to(device),
                           transfer=True, weights=weights.to(device))
        totals = errors.double() if totals is None else totals + errors.double()
        count += int(weights.sum())
    model.train(was_training)
    return (totals / max(count, 1)).tolist()
