"""The text side of vision-language checkpoints that transformers has no text-only causal LM class
for: Kimi-K2.5 (a DeepSeek-V3 language model) and Muse Glimmer. The checkpoint loads whole, as
transformers itself converts its weights, then its language model and LM head become one causal
LM and the vision tower is dropped. (Qwen3.5's folders need none of this: transformers maps them
to `Qwen3_5ForCausalLM` itself.)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

# Vision-language model types whose text side loads here.
TEXT_SIDES = ("kimi_k25", "muse_glimmer")


@functools.cache
def muse_glimmer_causal_lm() -> type:
    """`MuseGlimmerTextForCausalLM`, defined on first use (Muse Glimmer arrived in transformers 5.25)."""
    from transformers import GenerationMixin
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.models.muse_glimmer.configuration_muse_glimmer import MuseGlimmerTextConfig
    from transformers.models.muse_glimmer.modeling_muse_glimmer import MuseGlimmerPreTrainedModel, MuseGlimmerTextModel

    class MuseGlimmerTextForCausalLM(MuseGlimmerPreTrainedModel, GenerationMixin):
        """Muse Glimmer's language model and LM head: the logits of `MuseGlimmerForConditionalGeneration`
        on text (the output multiplier, then the tanh soft-cap, in its order of operations, so the bits
        are the same). Its embedding normalises what it looks up (`embed_tokens.embed_norm`); the DFlash
        drafter reads the raw rows instead (`Target.embed`)."""

        config_class = MuseGlimmerTextConfig

        def __init__(self, config: MuseGlimmerTextConfig) -> None:
            super().__init__(config)
            self.model = MuseGlimmerTextModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            # Image and video placeholder ids, embedded as token 0 as the full model does (no pixels here).
            self.placeholder_ids: tuple[int, ...] = ()
            self.post_init()

        def get_input_embeddings(self) -> nn.Module:
            return self.model.embed_tokens

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

        def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.LongTensor | None = None, cache: Any = None,
                    inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                    logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> CausalLMOutputWithPast:
            if inputs_embeds is None and input_ids is not None and self.placeholder_ids:
                placeholder = torch.isin(input_ids, torch.tensor(self.placeholder_ids, device=input_ids.device))
                input_ids = input_ids.masked_fill(placeholder, 0)
            cache = kwargs.pop("past_key_values", None) if cache is None else cache  # the name before 5.2x
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(out.last_hidden_state[:, keep, :])
            c = self.config
            logits = logits * c.output_multiplier
            logits = logits / c.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * c.final_logit_softcapping
            return CausalLMOutputWithPast(logits=logits, cache=out.cache, hidden_states=out.hidden_states,
                                          attentions=out.attentions)

    return MuseGlimmerTextForCausalLM


def text_side(vl: Any) -> Any:
    """The causal LM made of a loaded vision-language model's language model and LM head."""
    from transformers import AutoModelForCausalLM

    cfg = vl.config
    text = cfg.get_text_config()
    with torch.device("meta"):  # every module is replaced by the loaded one below
        if cfg.model_type == "muse_glimmer":
            lm = muse_glimmer_causal_lm()(text)
        else:
            lm = AutoModelForCausalLM.from_config(text)
    lm.model = vl.model.language_model
    lm.lm_head = vl.lm_head
    if cfg.model_type == "muse_glimmer":
        lm.placeholder_ids = tuple(i for i in (cfg.image_token_id, cfg.video_token_id) if i is not None)
    lm.generation_config = vl.generation_config
    if getattr(vl, "hf_device_map", None):
        lm.hf_device_map = vl.hf_device_map
    return lm.eval()


def load_text_side(path: str, **kwargs: Any) -> Any:
    """`from_pretrained` for a vision-language folder or hub id whose type is in TEXT_SIDES."""
    from transformers import AutoModelForImageTextToText

    return text_side(AutoModelForImageTextToText.from_pretrained(path, **kwargs))
