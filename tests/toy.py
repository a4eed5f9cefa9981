"""A tiny random Llama target with a tiny vocabulary, for exact distribution tests.

Its whole output distribution can be enumerated, which the real model's cannot.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_core.targets import Target


class ToyTokenizer:
    chat_template = None
    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"t{i}" for i in ids)


def toy_target(vocab: int = 4, seed: int = 0) -> Target:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper than the default init, so p is far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = None
    return Target(model=model, tokenizer=ToyTokenizer(), name="toy", device=torch.device("cpu"),
                  dtype=torch.float32)
