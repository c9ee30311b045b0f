"""Everything hybridlm does only to fit transformers' conventions (5.x), in one place: when transformers changes,
this is the module to read.

* ``generate()`` passes the cache as ``cache=`` and reads it back from ``outputs.cache``; it must not build its
  own ``DynamicCache`` (:class:`GenerationSupport`), and it passes arguments the model ignores
  (:func:`forward_kwargs`).
* ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` learn ``model_type="hybridlm"`` when the model
  classes are defined (:func:`register_auto_classes`).
"""

from __future__ import annotations

#: Arguments transformers passes to ``forward`` that hybridlm's models do not use: outputs are always returned
#: as output dataclasses.
IGNORED_FORWARD_KWARGS = ("return_dict",)

#: Arguments transformers may pass that hybridlm cannot honour: an error rather than a silently different output.
UNSUPPORTED_FORWARD_KWARGS = ("output_attentions", "output_hidden_states")


class GenerationSupport:
    """Mixin for a causal LM with hybridlm's own cache, so that transformers' ``generate()`` works with it:
    ``forward(cache=...)`` continues a :class:`~hybridlm.HybridCache`, and ``use_cache=True`` starts one."""

    #: SSM states cannot be rolled back: transformers must not use assisted (speculative) decoding.
    _is_stateful = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not build a transformers DynamicCache: forward makes a HybridCache


def forward_kwargs(owner: str, kwargs: dict) -> dict:
    """``kwargs`` of a ``forward`` call without what transformers passes and hybridlm ignores; raises on what
    hybridlm cannot honour (naming ``owner``, the model class)."""
    for name in UNSUPPORTED_FORWARD_KWARGS:
        if kwargs.get(name):
            raise ValueError(f"{owner}: {name} is not supported")
    return {key: value for key, value in kwargs.items()
            if key not in IGNORED_FORWARD_KWARGS and key not in UNSUPPORTED_FORWARD_KWARGS}


def register_auto_classes(config_class, model_class, causal_lm_class) -> None:
    """Make ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` load ``config_class.model_type``."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, model_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, causal_lm_class, exist_ok=True)
