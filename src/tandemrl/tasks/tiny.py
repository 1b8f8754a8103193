"""A tiny policy built in code: a byte-level BPE tokenizer trained on the spot and a random-init
causal LM from a config. Nothing is downloaded; used by the embedded default and by the tests.

A byte-level BPE survives `save_pretrained` + `AutoTokenizer` under transformers 5 (a word-level
character tokenizer saved beside a qwen2 config silently loses its whitespace).
"""

from __future__ import annotations

import string
from typing import Any

# ChatML; with tools, Qwen2.5's Hermes form: schemas in a system turn, tool answers grouped into one
# user turn of <tool_response> blocks (what rollout/chat.py must handle for real Qwen models)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    "Call a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% elif not (tools and loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE over letters, digits and punctuation, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [string.ascii_letters + " " + string.digits + string.punctuation, "the answer is 42. user assistant system"]
    tok.train_from_iterator(corpus * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    return tokenizer


def build_model(tokenizer: Any, *, model_type: str = "qwen2", seed: int = 0, **overrides: Any) -> Any:
    """A small random-init causal LM of `model_type` (qwen2, llama, qwen3, ...) sized by `overrides`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    shape.update(overrides)
    config = AutoConfig.for_model(model_type, **shape)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # transformers' default: sdpa, eager where it lacks it (Gemma 2)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny(path: str, *, model_type: str = "qwen2", seed: int = 0, **overrides: Any) -> str:
    """Builds a tiny model + tokenizer and saves both with `save_pretrained` into `path`."""
    tokenizer = build_tokenizer()
    build_model(tokenizer, model_type=model_type, seed=seed, **overrides).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
