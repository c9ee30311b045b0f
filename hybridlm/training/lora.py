"""LoRA through ``peft`` (the ``[lora]`` extra) on every linear layer of a hybrid: attention projections, the
Mamba / Mamba-2 input, x, dt and output projections, the MLPs, every MoE expert and router. Only the tied LM head
is left out (an adapter on it would also change the input embeddings once merged).

Every mixer calls its projections as modules (never ``F.linear`` on their weights), so an adapter on any of them
takes part in the forward; ``tests/training/test_finetune.py`` checks each adapted module changes the logits.
"""

from __future__ import annotations

import math

from torch import nn


def _peft():
    try:
        import peft
    except ImportError as error:
        raise ImportError("LoRA needs peft: pip install 'hybridlm[lora]'") from error
    return peft


def linear_module_names(model) -> list[str]:
    """Full names of the linear layers LoRA adapts: every ``nn.Linear`` but the output head."""
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not head]


def add_lora(model, rank: int = 8, alpha: float | None = None, dropout: float = 0.0,
             targets: list[str] | None = None):
    """``model`` wrapped by ``peft`` with rank-``rank`` adapters (scale ``alpha / rank``; ``alpha`` defaults to
    ``2 * rank``) on ``targets`` (full module names; default :func:`linear_module_names`); only the adapters
    train."""
    peft = _peft()
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"--lora rank must be a positive integer, got {rank!r}")
    if alpha is not None and not (isinstance(alpha, (int, float)) and 0 < alpha < math.inf):
        raise ValueError(f"--lora-alpha must be a finite number > 0 (0 would turn the adapters off), got {alpha!r}")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                             target_modules=linear_module_names(model) if targets is None else targets,
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def lora_modules(model) -> dict[str, nn.Module]:
    """The adapted layers of a peft model, by name."""
    return {name: module for name, module in model.named_modules() if hasattr(module, "lora_A")}


def merge_lora(model):
    """The base model with the adapters folded into its weights (``W + scale * B A``); a plain
    :class:`~hybridlm.HybridForCausalLM` again."""
    return model.merge_and_unload()
