"""What a `tandem train` run resolved to: every derived setting worked out once, on CPU, before anything
is built. `TrainConfig.resolve()` (config.py) writes it, and holds every rule spanning several leaves;
cli/build.py only builds objects from it; `tandem train --print_config` prints it.

Invariant: the sampler and the trainer read the same `SamplingParams` (`Plan.sampling`), so the
trainer scores every sampled token under the distribution it was drawn from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tandemrl.generation.base import EngineConfig, GeneratorConfig, HFConfig, RemoteConfig
from tandemrl.memory import MemoryPlan
from tandemrl.pipeline.settings import LoopSettings
from tandemrl.types import SamplingParams


@dataclass(frozen=True, kw_only=True)
class EngineSizing:
    """The colocated engine's size for this run: the slot a memory plan fills (KV cache, batch, fraction).

    Written by config.py's `_engine_sizing`; cli/build.py hands it to the engine unchanged."""

    max_model_len: int  # one generation round's longest sequence: prompt + completion (or a tool conversation)
    max_num_seqs: int  # at most one generation round's sequences
    gpu_memory_utilization: float  # --gpu_memory_utilization, or its colocated default


JUDGE_MEMORY_FRACTION = 0.2
"""GPU memory fraction of an in-process judge engine (beside the policy's colocated engine and trainer)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A run, resolved. Every field is written once, by `TrainConfig.resolve()`."""

    sampling: SamplingParams
    """The one sampling object: --temperature/--top_p/... with --generation_kwargs applied, max_tokens from
    --max_completion_length. The sampler draws from it and the trainer scores under it."""
    engine: EngineSizing | None
    """The colocated engine's sizing (None with --generator hf or rollout servers)."""
    generator: GeneratorConfig
    """The policy's backend: EngineConfig (sized by `engine`), HFConfig, or RemoteConfig (API key applied)."""
    judge: GeneratorConfig | None
    """The LLM judge's backend: RemoteConfig (API key applied) or its own EngineConfig; None without one."""
    loop: LoopSettings
    """The RL loop's settings (pipeline/settings.py)."""
    notes: tuple[str, ...] = ()
    """What resolution decided that the user should hear (cli/ prints them as warnings)."""
    memory: MemoryPlan | None = None
    """The memory plan of the run on its GPU (memory.py): cli/build.py makes it before anything loads, applies
    its levers and sizes to the config and resolves it again with them; None on a CPU."""

    def with_max_steps(self, max_steps: int) -> Plan:
        """This plan training `max_steps` steps (--num_train_epochs decides them once the data is loaded)."""
        return dataclasses.replace(self, loop=dataclasses.replace(self.loop, max_steps=max_steps))

    def to_dict(self) -> dict[str, Any]:
        """Plain values for `--print_config` and the run directory; secrets left out."""
        return {
            "sampling": _plain(self.sampling),
            "engine": _plain(self.engine),
            "generator": {"backend": _BACKENDS[type(self.generator)], **_plain(self.generator)},
            "judge": None if self.judge is None else {"backend": _BACKENDS[type(self.judge)], **_plain(self.judge)},
            "loop": _plain(self.loop),
            "notes": list(self.notes),
        }


_BACKENDS = {EngineConfig: "engine", HFConfig: "hf", RemoteConfig: "remote"}


def _plain(record: Any) -> Any:
    """A dataclass as a dict of YAML-safe values, without the API key. Example: RemoteConfig(api_key="k") -> no api_key."""
    if record is None:
        return None
    values = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name != "api_key"}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
