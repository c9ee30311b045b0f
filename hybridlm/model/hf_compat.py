"""Everything hybridlm does only to fit transformers' conventions (5.x), in one place: when transformers changes,
this is the module to read.

* ``generate()`` passes the cache as ``cache=`` and reads it back from ``outputs.cache``; it must not build its
  own ``DynamicCache`` (:class:`GenerationSupport`), and it passes arguments the model ignores
  (:func:`forward_kwargs`).
* Assisted decoding (``assistant_model=``, ``prompt_lookup_num_tokens=``) needs a cache before the first forward
  and rolls it back with ``crop`` (:class:`GenerationSupport`).
* Without an ``attention_mask``, ``generate()`` infers one as ``ids != pad_token_id``, also for a draft model's
  input, where pad may be an ordinary token of the output (:class:`GenerationSupport`).
* ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` learn ``model_type="hybridlm"`` when the model
  classes are defined (:func:`register_auto_classes`).
"""

from __future__ import annotations

import torch

#: Arguments transformers passes to ``forward`` that hybridlm's models do not use: outputs are always returned
#: as output dataclasses.
IGNORED_FORWARD_KWARGS = ("return_dict",)

#: Arguments transformers may pass that hybridlm cannot honour: an error rather than a silently different output.
UNSUPPORTED_FORWARD_KWARGS = ("output_attentions", "output_hidden_states")


class GenerationSupport:
    """Mixin for a causal LM with hybridlm's own cache, so that transformers' ``generate()`` works with it:
    ``forward(cache=...)`` continues a :class:`~hybridlm.HybridCache`, and ``use_cache=True`` starts one."""

    #: The cache rolls back (``HybridCache.crop``), so transformers may use assisted decoding; whether a given
    #: cache can is its ``is_croppable``, which generate() checks after the first forward.
    _is_stateful = False

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not build a transformers DynamicCache: forward makes a HybridCache

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """Leaves the cache to ``forward``, except in assisted decoding, which needs one before its first forward
        (to record its past and roll back): the target's and the assistant's are made here."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                              max_cache_length)
        from transformers.generation.configuration_utils import GenerationMode

        assisted = generation_mode == GenerationMode.ASSISTED_GENERATION or generation_config.is_assistant
        if assisted and model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = self.new_cache(batch_size, max_length=max_cache_length,
                                                   policy=model_kwargs.get("cache_policy"))
            if generation_config.is_assistant:  # its drafts are cropped after the target's verification
                model_kwargs["cache"].activate_past_recording()


    def _prepare_attention_mask_for_generation(self, inputs_tensor, generation_config, model_kwargs):
        """A draft model's input (assisted decoding) without a mask holds real tokens only (a padded prompt's mask
        comes with it), so pad there is an ordinary token: all ones. Otherwise transformers' mask; a prompt
        holding ``pad_token_id`` after a real token is refused, saying that the mask was inferred from it."""
        if generation_config.is_assistant:
            return torch.ones(inputs_tensor.shape[:2], dtype=torch.long, device=inputs_tensor.device)
        mask = super()._prepare_attention_mask_for_generation(inputs_tensor, generation_config, model_kwargs)
        inside = (mask[:, 1:] < mask[:, :-1]).nonzero()  # a masked position after a real token
        if len(inside):
            row, column = inside[0].tolist()
            pad = generation_config.pad_token_id
            raise ValueError(f"generate: attention_mask was inferred from pad_token_id={pad} (ids != pad_token_id), "
                             f"and the prompt holds {pad} after a real token (row {row}, position {column + 1}); "
                             "pass attention_mask= (ones where the id is an ordinary token) or another pad_token_id")
        return mask


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
