"""Rewards: functions in TRL's signature `fn(prompts=, completions=, **columns) -> list[float | None]`, called by keyword.

builtins.py holds math_accuracy, format and length; base.py loads functions by name and scores a
group of completions with all of them. A generative judge will be one more (async) reward function.
"""

from tandemrl.rewards.base import RewardFunc, load_reward_funcs, score

__all__ = ["RewardFunc", "load_reward_funcs", "score"]
