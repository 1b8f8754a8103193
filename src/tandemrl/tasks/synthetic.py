"""The embedded default task: write characters of the class the prompt names.

A prompt is `digits:`, `lowercase:` or `uppercase:`; the reward is the fraction of the completion's
non-space characters that belong to that class. A random-init policy over a byte-level vocabulary
scores about 0.1-0.2; GRPO alone (no supervised warm-up) brings it above 0.9 in about a hundred
steps on a CPU, because every token moves the reward a little and the prompt must be read to win.
"""

from __future__ import annotations

import random
import string

from tandemrl.tasks.base import Task
from tandemrl.types import Example

CLASSES = {"digits": string.digits, "lowercase": string.ascii_lowercase, "uppercase": string.ascii_uppercase}
TINY_MODEL = "tandem:tiny"


def synthetic_examples(num_examples: int = 3000, seed: int = 0) -> list[Example]:
    """Example: -> [Example(prompt="digits:", columns={"char_class": "digits"}, index=0), ...]"""
    rng = random.Random(seed)
    names = sorted(CLASSES)
    examples = []
    for i in range(num_examples):
        name = rng.choice(names)
        examples.append(Example(prompt=f"{name}:", columns={"char_class": name}, index=i))
    return examples


def char_class_reward(prompts: list, completions: list[str], char_class: list[str], **_: object) -> list[float]:
    """Fraction of non-space characters in the requested class; an empty completion scores 0.

    Example: char_class_reward(["digits:"], ["12a4"], char_class=["digits"]) -> [0.75]
    """
    scores = []
    for text, name in zip(completions, char_class):
        chars = [c for c in text if not c.isspace()]
        scores.append(sum(c in CLASSES[name] for c in chars) / len(chars) if chars else 0.0)
    return scores


def build_task(data: str | None = None, split: str = "train") -> Task:
    if data:
        raise ValueError("the synthetic task makes its own data; drop --dataset or pick another --task")
    return Task(
        name="synthetic",
        description="write characters of the class the prompt names (digits, lowercase, uppercase)",
        load=synthetic_examples,
        reward_funcs=["tandemrl.tasks.synthetic:char_class_reward"],
        recipe=dict(
            model=TINY_MODEL,
            max_steps=150,
            num_prompts_per_step=16,
            num_generations=8,
            max_completion_length=8,
            max_prompt_length=16,
            learning_rate=1e-3,
            # packed attention is dense over a micro-batch (a block-diagonal mask): with ~11-token
            # sequences, 512-token micro-batches train 2.7x faster on a CPU than one of 1,400 tokens
            max_tokens_per_microbatch=512,
            warmup_steps=0,
            temperature=1.0,
            loss_type="grpo",
            save_steps=50,
            log_completions_steps=25,
        ),
        # With LoRA the tiny policy's tied embeddings (init std 0.02) stay frozen, and they bound every logit
        # to about +-1.3: adapters alone stay at a random policy's reward. The final norm sets the logits'
        # scale; trained whole at a rate fit for weights of ~1 it grows while the adapters (at the full
        # fine-tuning's 1e-3) learn to read the prompt: ~0.99 by step 30 (README, "LoRA").
        lora_recipe=dict(lora_modules_to_save=("model.norm",), lora_modules_to_save_learning_rate=1.0),
    )
