"""TRL's settings read as tandem's, so a yaml written for TRL 1.16's `trl grpo --config` runs unchanged.

Every key of TRL 1.16's GRPOConfig (with transformers' TrainingArguments), ScriptArguments and ModelConfig
is one of: a tandem flag of the same name and meaning; TRANSLATED to tandem's flags (one info line); or
IGNORED, not applying to tandem (one info line). A few, set to anything but TRL's default, would change
training in a way tandem cannot honour: REFUSED, one error naming them. tests/fixtures/trl_keys.json holds
TRL 1.16's keys and a test checks each has exactly one place here. TRL's value forms are read too:
`bf16: true`, `scale_rewards: true`, `top_k: 0` (off), `report_to: none`, `logging_steps: 0.1` (a ratio).
"""

from __future__ import annotations

import os
from typing import Any

from tandemrl.cli.args import to_bool
from tandemrl.data.load import FILE_SUFFIXES
from tandemrl.types import every_steps

# TRL key -> what tandem makes of it (the key's value is given to the rule in translate_keys)
TRANSLATED = {
    "model_name_or_path": "--model",
    "dataset_name": "--dataset",
    "dataset_config": "--dataset NAME:CONFIG",
    "dataset_train_split": "--dataset_split",
    "dataset_test_split": "--eval_dataset_split",
    "eval_strategy": "--eval_dataset (dataset_name's dataset, split dataset_test_split) unless no",
    "reward_model_name_or_path": "--reward_model",
    "per_device_train_batch_size": "--num_prompts_per_step (x gradient_accumulation_steps x ranks / num_generations)",
    "gradient_accumulation_steps": "--num_prompts_per_step (with per_device_train_batch_size)",
    "vllm_gpu_memory_utilization": "--gpu_memory_utilization",
    "vllm_max_model_length": "--max_model_len",
    "vllm_tensor_parallel_size": "--tensor_parallel_size",
    "vllm_enable_sleep_mode": "--sleep_level 2",
    "vllm_mode": "--rollout_mode",
    "vllm_server_base_url": "--rollout_server_urls",
    "vllm_server_host": "--rollout_server_urls (with vllm_server_port)",
    "vllm_server_port": "--rollout_server_urls (with vllm_server_host)",
    "vllm_server_timeout": "--rollout_server_timeout",
    "vllm_group_port": "--weight_sync_port",
    "vllm_importance_sampling_correction": "--tis_cap 0 when false",
    "vllm_importance_sampling_mode": "--tis_mode",
    "vllm_importance_sampling_clip_max": "--tis_cap",
    "vllm_importance_sampling_cap": "--tis_cap",
    "vllm_importance_sampling_clip_min": "--tis_min",
    "model_revision": "--model_init_kwargs revision",
    "use_peft": "--lora_r (16 when not given)",
    "resume_from_checkpoint": "--resume",
    "log_completions": "--log_completions_steps 0 when false",
}

# keys that do not apply to tandem, by why (each set is ignored with one info line)
IGNORED_BECAUSE = {
    "the engine is built in (no vLLM)": (
        "use_vllm", "vllm_model_impl", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
        "use_transformers_paged", "cache_implementation", "ds3_gather_for_generation", "use_cache",
    ),
    "torchrun starts FSDP2 by itself": (
        "fsdp", "fsdp_config", "accelerator_config", "parallelism_config", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend", "local_rank", "average_tokens_across_devices",
    ),
    "tandem's data path has no dataloader (prompts are tokenized once and drawn in --shuffle_dataset's order)": (
        "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
        "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order", "remove_unused_columns",
        "label_names", "train_sampling_strategy", "length_column_name", "pad_to_multiple_of",
        "data_seed", "dataset_streaming", "streaming", "test_split_size", "ignore_data_skip",
    ),
    "tandem logs every step to metrics.jsonl and TensorBoard, and prints its own console": (
        "logging_strategy", "logging_first_step", "log_on_each_node", "logging_nan_inf_filter", "include_num_input_tokens_seen",
        "log_level", "log_level_replica", "disable_tqdm", "project", "trackio_space_id", "trackio_bucket_id",
        "trackio_static_space_id", "num_completions_to_print", "log_multimodal", "log_unique_prompts", "skip_memory_metrics",
        "debug",
    ),
    "tandem evaluates every --eval_steps when --eval_dataset is given": (
        "eval_delay", "per_device_eval_batch_size", "prediction_loss_only", "eval_on_start",
        "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps", "include_for_metrics",
        "batch_eval_metrics", "bf16_full_eval", "fp16_full_eval", "do_train", "do_eval", "do_predict",
        "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    ),
    "tandem saves HF checkpoints every --save_steps and does not push to the hub": (
        "save_strategy", "save_only_model", "save_on_each_node", "enable_jit_checkpoint", "push_to_hub", "hub_token",
        "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision",
        "restore_callback_states_from_checkpoint", "full_determinism",
    ),
    "tandem's optimizer is AdamW with its own fused kernels, compiled layers and float32 logprob head": (
        "optim_target_modules", "torch_compile_backend", "torch_compile_mode", "use_liger_kernel",
        "liger_kernel_config", "torch_empty_cache_steps", "tf32", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs",
        "cast_lm_head_to_fp32", "attn_implementation", "use_cpu", "ignore_bias_buffers", "lora_task_type",
    ),
}
IGNORED = {key: why for why, keys in IGNORED_BECAUSE.items() for key in keys}

# keys refused unless at TRL's default (value -> why tandem cannot honour another)
REFUSED = {
    "optim": "tandem trains with AdamW (adamw_* values are accepted)",
    "optim_args": "tandem's AdamW takes --adam_beta1/--adam_beta2/--adam_epsilon/--weight_decay",
    "lr_scheduler_kwargs": "tandem's schedules take no arguments",
    "label_smoothing_factor": "GRPO has no labels to smooth",
    "neftune_noise_alpha": "no NEFTune noise in tandem",
    "fp16": "tandem computes in bfloat16 (--bf16), never float16",
    "auto_find_batch_size": "tandem sizes micro-batches by tokens (--max_tokens_per_microbatch)",
    "deepspeed": "use torchrun (FSDP2) instead of DeepSpeed",
    "activation_checkpointing": "use --gradient_checkpointing",
    "multi_objective_aggregation": "tandem sums weighted rewards, then normalizes (sum_then_normalize)",
    "use_adaptive_entropy": "tandem's entropy bonus is the fixed --entropy_coef",
    "entropy_coef_min": "tandem's entropy bonus is the fixed --entropy_coef",
    "entropy_coef_max": "tandem's entropy bonus is the fixed --entropy_coef",
    "entropy_coef_delta": "tandem's entropy bonus is the fixed --entropy_coef",
    "entropy_target": "tandem's entropy bonus is the fixed --entropy_coef",
    "sapo_temperature_neg": "no sapo loss in tandem",
    "sapo_temperature_pos": "no sapo loss in tandem",
    "vespo_k_pos": "no vespo loss in tandem",
    "vespo_lambda_pos": "no vespo loss in tandem",
    "vespo_k_neg": "no vespo loss in tandem",
    "vespo_lambda_neg": "no vespo loss in tandem",
    "off_policy_mask_threshold": "tandem weighs stale tokens by truncated IS (--tis_mode, --tis_cap)",
    "max_tool_calling_iterations": "use --max_turns (tool rounds + 1)",
    "log_completions_hub_repo": "tandem writes completions.jsonl in the run directory",
    "vllm_structured_outputs_regex": "no structured outputs in tandem's engine",
    "lora_target_parameters": "use --lora_target_modules",
    "use_rslora": "tandem's LoRA scales by lora_alpha / lora_r",
    "use_dora": "no DoRA in tandem",
    "load_in_8bit": "no quantized training in tandem",
    "load_in_4bit": "no quantized training in tandem",
    "bnb_4bit_quant_type": "no quantized training in tandem",
    "use_bnb_nested_quant": "no quantized training in tandem",
    "bnb_4bit_quant_storage": "no quantized training in tandem",
    "datasets": "pass one dataset by dataset_name (a dataset mixture is not read)",
}
TRL_DEFAULTS = {
    "optim": "adamw_torch_fused", "multi_objective_aggregation": "sum_then_normalize", "sapo_temperature_neg": 1.05,
    "sapo_temperature_pos": 1.0, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0,
    "entropy_coef_min": 0.0, "entropy_coef_max": 1.0, "entropy_coef_delta": 0.005, "entropy_target": 0.2,
    "label_smoothing_factor": 0.0, "bnb_4bit_quant_type": "nf4", "datasets": [],
}  # defaults that are not None/False (the REFUSED keys' others are)

REFUSED_BOOLS = frozenset({
    "fp16", "auto_find_batch_size", "activation_checkpointing", "use_adaptive_entropy", "use_rslora", "use_dora", "load_in_8bit",
    "load_in_4bit", "use_bnb_nested_quant",
})  # fmt: skip
"""The REFUSED keys that are TRL bools (false by default): read in every bool form, refused only when true."""

TRL_KEYS = frozenset(TRANSLATED) | frozenset(IGNORED) | frozenset(REFUSED)
"""TRL's keys that are not tandem flags: accepted in yaml and on the command line."""

HINTS = {"lr": "learning_rate", "epochs": "num_train_epochs", "num_epochs": "num_train_epochs", "kl_coef": "beta",
         "batch_size": "per_device_train_batch_size", "train_batch_size": "per_device_train_batch_size",
         "model_name": "model", "steps": "max_steps", "group_size": "num_generations", "max_new_tokens": "max_completion_length",
         "output": "output_dir", "config_file": "config"}  # fmt: skip
"""Names people type that are no flag, for "did you mean" (difflib alone sends --lr to --lora_r)."""

TRL_BATCH = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}  # TRL's defaults
BUILTIN_REWARDS = {"accuracy_reward": "math_accuracy", "reasoning_accuracy_reward": "math_accuracy"}
LINKED = (("dataset_name", "dataset_config", "eval_strategy"), ("vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port"))
"""TRL keys read together: a flag of one group takes the yaml's others of it along (translate_keys reads them as one)."""
LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save")


def over_yaml(yaml_values: dict[str, Any], flags: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two sources, before translate_keys, with flags winning over keys TRL reads together: the yaml's keys
    of a LINKED group move to the flags when a flag sets one of it, `--use_peft false` drops the yaml's LoRA
    keys (TRL reads them only with use_peft), and a step's batch set by flags (--num_prompts_per_step, or TRL's
    batch keys) drops the yaml's other form of it. Example: ({"dataset_name": "d"}, {"dataset_config": "c"}) ->
    ({}, {"dataset_name": "d", "dataset_config": "c"}), which translates to --dataset d:c
    """
    yaml_values, flags = dict(yaml_values), dict(flags)
    for group in LINKED:
        if any(k in flags for k in group):
            flags = {**{k: yaml_values.pop(k) for k in group if k in yaml_values}, **flags}
    if "num_prompts_per_step" in flags:
        for key in TRL_BATCH:
            yaml_values.pop(key, None)
    elif any(k in flags for k in TRL_BATCH):
        yaml_values.pop("num_prompts_per_step", None)
    if "use_peft" in flags and not to_bool("use_peft", flags["use_peft"]):
        for key in ("use_peft", *LORA_KEYS):
            yaml_values.pop(key, None)
    return yaml_values, flags


def translate_keys(values: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """`values` (one source: yaml or flags) with TRL's keys made tandem's; a line per key in `notes`.
    per_device_train_batch_size and gradient_accumulation_steps stay, for finish() to combine.

    Example: {"model_name_or_path": "m", "use_vllm": True} -> {"model": "m"}, notes 2 lines
    """
    out = {k: v for k, v in values.items() if k not in TRL_KEYS or k in TRL_BATCH}
    refused = [k for k in values if k in REFUSED and not _at_default(k, values[k])]
    if refused:
        raise ValueError("; ".join(f"{k}: {REFUSED[k]}" for k in refused) + " (TRL settings tandem cannot honour: remove them)")
    ignored = sorted(k for k in values if k in IGNORED or k in REFUSED)
    for why in dict.fromkeys(IGNORED.get(k, "they are at TRL's default") for k in ignored):
        keys = [k for k in ignored if IGNORED.get(k, "they are at TRL's default") == why]
        notes.append(f"TRL setting(s) {', '.join(keys)} ignored: {why}")
    for key in (k for k in values if k in TRANSLATED and k not in TRL_BATCH):
        value = values[key]
        before = dict(out)
        _translate_one(key, value, values, out)
        changed = {k: v for k, v in out.items() if before.get(k, _UNSET) != v}
        said = ", ".join(f"--{k} {_show(v)}" for k, v in changed.items()) or _unchanged(key, values)
        notes.append(f"TRL setting {key}: {_show(value)} -> {said}")
    return out


def _unchanged(key: str, values: dict[str, Any]) -> str:
    """What a TRL key that set no flag did: read with the keys it goes with (dataset_config into dataset_name's
    --dataset), else nothing. Example: ("dataset_config", {"dataset_name": "d", ...}) -> "read with dataset_name"."""
    partners = [k for group in LINKED if key in group for k in group if k != key and values.get(k) is not None]
    return f"read with {', '.join(partners)}" if partners else "nothing (its default)"


_UNSET = object()


def _translate_one(key: str, value: Any, values: dict[str, Any], out: dict[str, Any]) -> None:
    simple = {
        "model_name_or_path": "model", "dataset_train_split": "dataset_split", "dataset_test_split": "eval_dataset_split",
        "reward_model_name_or_path": "reward_model", "vllm_gpu_memory_utilization": "gpu_memory_utilization",
        "vllm_max_model_length": "max_model_len", "vllm_tensor_parallel_size": "tensor_parallel_size",
        "vllm_server_timeout": "rollout_server_timeout", "vllm_group_port": "weight_sync_port",
        "vllm_importance_sampling_mode": "tis_mode", "vllm_importance_sampling_clip_max": "tis_cap",
        "vllm_importance_sampling_cap": "tis_cap", "vllm_importance_sampling_clip_min": "tis_min",
    }  # fmt: skip
    if value is None:
        return  # TRL's "unset": tandem's default
    if key in simple:
        out[simple[key]] = value
    elif key in ("dataset_name", "dataset_config"):
        name, config = values.get("dataset_name"), values.get("dataset_config")
        if name:
            out["dataset"] = f"{name}:{config}" if config else name
    elif key == "eval_strategy":
        _eval_strategy(value, values, out)
    elif key == "vllm_enable_sleep_mode":
        if to_bool(key, value):
            out["sleep_level"] = 2  # TRL sleeps vLLM at level 2 (KV cache and weights)
    elif key == "vllm_mode":
        if value not in ("server", "colocate"):
            raise ValueError(f"setting vllm_mode: {value!r} is not one of server, colocate")
        out["rollout_mode"] = value
        if value == "server" and not values.get("vllm_server_base_url"):
            host, port = values.get("vllm_server_host") or "0.0.0.0", values.get("vllm_server_port") or 8000
            out["rollout_server_urls"] = [f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"]
    elif key == "vllm_server_base_url":
        if values.get("vllm_mode") == "server":
            out["rollout_server_urls"] = [str(value)]
    elif key in ("vllm_server_host", "vllm_server_port"):
        pass  # read by vllm_mode server
    elif key == "vllm_importance_sampling_correction":
        if not to_bool(key, value):
            out["tis_cap"] = 0.0
    elif key == "model_revision":
        if value != "main":
            out["model_init_kwargs"] = {**(out.get("model_init_kwargs") or {}), "revision": value}
    elif key == "use_peft":
        if to_bool(key, value):
            out.setdefault("lora_r", 16)  # TRL's ModelConfig default
        else:
            for lora_key in LORA_KEYS:
                out.pop(lora_key, None)  # TRL reads them only with use_peft
    elif key == "resume_from_checkpoint":
        if _path_or_bool(key, value):
            out["resume"] = True  # a path or true: the newest complete checkpoint of output_dir
    elif key == "log_completions":
        if not to_bool(key, value):
            out["log_completions_steps"] = 0
    else:
        raise AssertionError(f"TRANSLATED key {key} has no rule")


def _eval_strategy(value: Any, values: dict[str, Any], out: dict[str, Any]) -> None:
    """TRL's script evaluates on dataset_name's dataset_test_split (--eval_dataset_split) unless eval_strategy is
    "no"; tandem evaluates every --eval_steps, so any other strategy names the eval dataset. An --eval_dataset
    given beside it wins. Example: {"dataset_name": "d", "eval_strategy": "steps"} -> --eval_dataset d"""
    name, config = values.get("dataset_name"), values.get("dataset_config")
    if str(value) == "no" or not name or values.get("eval_dataset"):
        return
    if str(name).endswith(FILE_SUFFIXES):
        raise ValueError(
            f"eval_strategy {value} evaluates on dataset_name's test split, and {name} is one file with no such split; "
            "pass --eval_dataset FILE, or eval_strategy no"
        )
    out["eval_dataset"] = f"{name}:{config}" if config else name


def finish(values: dict[str, Any], notes: list[str], *, defaults: dict[str, Any]) -> dict[str, Any]:
    """The merged values (yaml < flags, keys already tandem's) with TRL's batch keys combined and TRL's
    value forms made tandem's; `defaults` are the flags' values when not given (TrainConfig's and the recipe's).

    Example: {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "num_generations": 8} ->
        {"num_prompts_per_step": 4, "num_generations": 8}
    """
    out = dict(values)
    _batch(out, notes, defaults)
    if isinstance(out.get("max_steps"), (int, float, str)) and _number("max_steps", out["max_steps"]) < 0:
        del out["max_steps"]  # TRL's -1: the epochs decide
        out.setdefault("num_train_epochs", 3.0)
        notes.append(f"TRL setting max_steps -1 -> --num_train_epochs {out['num_train_epochs']} decides the steps")
    if out.get("num_train_epochs") is not None and _number("max_steps", out.get("max_steps", -1)) > 0:
        notes.append(
            f"max_steps {float(out['max_steps']):g} and num_train_epochs {_number('num_train_epochs', out['num_train_epochs']):g} are both set: the epochs decide the steps here "
            "(TRL: a positive max_steps overrides the epochs); drop num_train_epochs to run max_steps"
        )
    forms = {"scale_rewards": _scale_rewards, "top_k": _top_k, "report_to": _report_to, "dtype": _dtype, "reward_funcs": _reward_funcs,
             "reward_weights": _reward_weights}  # fmt: skip
    for key, form in forms.items():
        if key in out and out[key] is not None:
            out[key] = form(out[key], notes)
    max_steps = int(_number("max_steps", out.get("max_steps", defaults.get("max_steps", 1))))
    epochs = out.get("num_train_epochs", defaults.get("num_train_epochs"))  # when set, they decide the steps
    for key in ("logging_steps", "save_steps", "eval_steps"):
        if key in out and out[key] is not None:
            out[key] = _steps_or_ratio(key, out[key], None if epochs is not None else max_steps, notes)
    return {k: v for k, v in out.items() if v is not None or defaults.get(k, _UNSET) is None}


def _batch(out: dict[str, Any], notes: list[str], defaults: dict[str, Any]) -> None:
    """TRL's batch: per_device_train_batch_size completions per rank per micro-batch, gradient_accumulation_steps
    micro-batches per optimizer step, so num_prompts_per_step = their product x ranks / num_generations."""
    given = {k: out.pop(k) for k in TRL_BATCH if k in out}
    if not given:
        return
    if "num_prompts_per_step" in out:
        raise ValueError(f"{', '.join(given)} and num_prompts_per_step set the same thing: give one of them")
    per_device, accumulation = (int(_number(k, given.get(k, d))) for k, d in TRL_BATCH.items())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = int(_number("num_generations", out.get("num_generations", defaults.get("num_generations", 8))))
    completions = per_device * accumulation * world
    if completions % group:
        raise ValueError(
            f"per_device_train_batch_size {per_device} x gradient_accumulation_steps {accumulation} x {world} rank(s) = {completions} "
            f"completions per step is not a multiple of num_generations {group} (TRL's rule too); change one of them"
        )
    out["num_prompts_per_step"] = completions // group
    notes.append(
        f"TRL batch: per_device_train_batch_size {per_device} x gradient_accumulation_steps {accumulation} x {world} rank(s) / "
        f"num_generations {group} -> --num_prompts_per_step {completions // group} (tandem packs micro-batches by tokens)"
    )
    spg = out.get("steps_per_generation")
    if spg is not None and accumulation > 1:  # TRL counts micro-batches, tandem optimizer steps
        steps = int(_number("steps_per_generation", spg))
        if steps % accumulation:
            raise ValueError(f"steps_per_generation {steps} (TRL: micro-batches) must be a multiple of gradient_accumulation_steps {accumulation}")
        out["steps_per_generation"] = steps // accumulation
        notes.append(f"TRL steps_per_generation {steps} micro-batches -> --steps_per_generation {steps // accumulation} optimizer steps")


def _at_default(key: str, value: Any) -> bool:
    default = TRL_DEFAULTS.get(key)
    if key in REFUSED_BOOLS:
        return value is None or not to_bool(key, value)  # `load_in_4bit: no` is TRL's default
    if key == "optim":
        return str(value).startswith("adamw")
    if default is None:
        return value in (None, False, "", "false", "False", [], {})
    return value == default or str(value) == str(default)


def _path_or_bool(key: str, value: Any) -> bool:
    """A key that takes a path or a bool (resume_from_checkpoint): a path is true. Example: "no" -> False"""
    try:
        return to_bool(key, value)
    except ValueError:
        return value != ""


def _number(key: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"setting {key}: {value!r} is not a number") from None


def _scale_rewards(value: Any, notes: list[str]) -> Any:
    """TRL's bool form: true = group, false = none."""
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):
        return "group" if to_bool("scale_rewards", value) else "none"
    return value


def _top_k(value: Any, notes: list[str]) -> Any:
    """TRL's (and vLLM's) 0 = off is tandem's -1."""
    return -1 if str(value).strip() == "0" else value


def _report_to(value: Any, notes: list[str]) -> list[str]:
    """TRL's forms: a name, a list, "none", "all"; TensorBoard (and JSONL) are always written here."""
    names = [value] if isinstance(value, str) else list(value)
    names = [str(n).strip() for n in names]
    if "all" in names:
        raise ValueError("report_to all: name the sinks (wandb, trackio); metrics.jsonl and TensorBoard are always written")
    if "tensorboard" in names:
        notes.append("report_to tensorboard: TensorBoard events are always written (runs/<dir>/)")
    return [n for n in names if n not in ("none", "tensorboard", "")]


def _dtype(value: Any, notes: list[str]) -> Any:
    """TRL's ModelConfig dtype loads the model so; tandem's --dtype is the master weights' (float32 or bfloat16)."""
    if value in ("auto", "float16", "fp16", "half"):
        notes.append(f"TRL setting dtype: {value} ignored: tandem keeps float32 weights and computes in bfloat16 on a GPU (--bf16)")
        return None
    return value


def _comma_list(value: Any) -> list[str]:
    """A list flag's values with commas splitting them too (no reward reference or weight holds one).

    Example: "a,b" -> ["a", "b"]; ["a", "b, c"] -> ["a", "b", "c"]
    """
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def _reward_weights(value: Any, notes: list[str]) -> list[Any]:
    """`reward_weights: 1,0.5` is two weights, as `reward_funcs: a,b` is two functions (yaml's numbers kept as they are)."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [w for item in items for w in (_comma_list(item) if isinstance(item, str) else [item])]


def _reward_funcs(value: Any, notes: list[str]) -> Any:
    """TRL's script names: accuracy_reward (tandem's math_accuracy), dotted paths my_lib.rewards.fn (module:function);
    `a,b` is two functions, as the list [a, b] (TRL would read one name, "a,b")."""
    given = list(value) if isinstance(value, (list, tuple)) else [value]
    names = _comma_list(value)
    out = []
    for name in names:
        name = str(name)
        if name in BUILTIN_REWARDS:
            out.append(BUILTIN_REWARDS[name])
        elif ":" not in name and "." in name and not name.endswith(".py"):
            module, _, fn = name.rpartition(".")
            out.append(f"{module}:{fn}")
        else:
            out.append(name)
    if out != given:
        notes.append(f"TRL reward_funcs {' '.join(map(str, given))} -> --reward_funcs {' '.join(out)}")
    return out


def _steps_or_ratio(key: str, value: Any, max_steps: int | None, notes: list[str]) -> Any:
    """TRL's form: a float below 1 is a ratio of the run's steps (ceil). Example: 0.1 of 150 steps -> 15.
    With `max_steps` None (--num_train_epochs decides the steps once the data is loaded) the ratio stays, for
    types.every_steps to take of those steps (cli/build.py says what it became)."""
    number = _number(key, value)
    if 0 < number < 1:
        if max_steps is None:
            notes.append(f"{key} {value} (TRL: a ratio of the run's steps, which --num_train_epochs decides once the data is loaded)")
            return number
        steps = every_steps(number, max_steps)
        notes.append(f"{key} {value} (TRL: a ratio of the run's {max_steps} steps) -> {steps}")
        return steps
    return value


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "(none)"
    return str(value)
