"""Tiny models and tokenizers built in-process for tests (no downloads).

The tokenizer is character-level with a ChatML-style template, so the prompt /
response split follows the same code path as a real chat model.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(chat_template: bool = True, pad: bool = True) -> PreTrainedTokenizerFast:
    chars = sorted(set(string.printable))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        eos_token="<eos>",
        pad_token="<pad>" if pad else None,
    )
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(vocab_size: int, seed: int = 0, dtype=torch.float64, layers: int = 2,
               hidden: int = 16) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation="sdpa",  # eager upcasts softmax to float32
    )
    model = LlamaForCausalLM(cfg).to(dtype)
    # Larger-than-default init so that gradients and scores are well away from zero.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    _norms_in_model_dtype(model)
    model.eval()
    return model


class _RMSNorm(torch.nn.Module):
    """LlamaRMSNorm computes in float32 whatever the model dtype; float64 reference
    tests need the whole function in float64."""

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, h):
        var = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(var + self.eps))


def _norms_in_model_dtype(model):
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                eps = getattr(child, "variance_epsilon", getattr(child, "eps", 1e-6))
                setattr(mod, child_name, _RMSNorm(child.weight, eps))


def save_tiny(directory, dtype=torch.float32, seed: int = 0, model=None):
    """Save a tiny Llama (or ``model``) and the chat tokenizer as a loadable HF directory."""
    tok = tiny_tokenizer()
    model = model if model is not None else tiny_llama(len(tok), seed=seed, dtype=dtype)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


# Twelve (prompt, response) records, arithmetic with wrong and right answers beside
# chit-chat: a pool for tests that train or score a tiny model on it (test_theorem.py,
# curvature/test_kronfluence.py).
ARITHMETIC_POOL = [
    ("What is 2+3?", "2+3=6. The answer is 6."),
    ("What is 4+4?", "4+4=9. The answer is 9."),
    ("Name a colour.", "Blue."),
    ("What is 7-2?", "7-2=4. The answer is 4."),
    ("Say hi.", "Hi there!"),
    ("What is 3*3?", "3*3=9. The answer is 9."),
    ("Spell cat.", "c-a-t"),
    ("What is 10/2?", "10/2=5. So 5."),
    ("What is 8+1?", "8+1=9. The answer is 9."),
    ("Count to 3.", "1, 2, 3."),
    ("What is 9-3?", "9-3=7. The answer is 7."),
    ("Say bye.", "Goodbye!"),
]
