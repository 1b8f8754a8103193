"""tandem: GRPO-family reinforcement learning with generation and training in tandem."""

from tandemrl.types import Batch, Completion, Example, Group, Rollout, SamplingParams, TokenTrace

__all__ = ["Batch", "Completion", "Example", "Group", "Rollout", "SamplingParams", "TokenTrace"]
__version__ = "0.1.0"
