"""Model implementations of the engine, and where their weights come from."""

from tandemrl.generation.engine.models.llama import LlamaForCausalLM, unsupported_reason
from tandemrl.generation.engine.models.loading import build_model, load_hf_config, weights_of

__all__ = ["LlamaForCausalLM", "build_model", "load_hf_config", "unsupported_reason", "weights_of"]
