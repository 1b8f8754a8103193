import pytest

from tandemrl.server.config import RolloutServerConfig, is_loopback


def test_loopback_hosts_need_no_key():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")
    RolloutServerConfig(host="127.0.0.1")


def test_non_loopback_needs_a_key_or_insecure(monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    with pytest.raises(ValueError, match="refusing to bind 0.0.0.0"):
        RolloutServerConfig(host="0.0.0.0")
    RolloutServerConfig(host="0.0.0.0", insecure=True)
    RolloutServerConfig(host="0.0.0.0", api_key="k")
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    assert RolloutServerConfig(host="0.0.0.0").api_key == "from-env"


def test_tensor_parallel_size_must_be_positive():
    from tandemrl.generation.base import EngineConfig

    with pytest.raises(ValueError, match="--tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    assert EngineConfig(tensor_parallel_size=2).tensor_parallel_size == 2


@pytest.mark.parametrize(
    "field, value, message",
    [("max_model_len", -5, "--max_model_len must be >= 0"), ("block_size", 0, "--block_size must be >= 1"),
     ("max_num_seqs", 0, "--max_num_seqs must be >= 1"), ("max_num_batched_tokens", 0, "--max_num_batched_tokens must be >= 1"),
     ("kv_cache_tokens", -1, "--kv_cache_tokens must be >= 0"), ("gpu_memory_utilization", 2.0, "--gpu_memory_utilization is a fraction"),
     ("gpu_memory_utilization", float("nan"), "--gpu_memory_utilization is a fraction")],
)  # fmt: skip
def test_engine_sizes_out_of_range_are_one_line_not_a_traceback(field, value, message):
    """Each was taken: max_model_len -5 and block_size 0 raised out of the engine's build (a traceback),
    max_num_seqs 0 an AssertionError, and the rest served or trained on nonsense."""
    from tandemrl.generation.base import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_max_lora_rank_is_the_engines_and_not_negative():
    assert RolloutServerConfig(max_lora_rank=16).max_lora_rank == 16
    with pytest.raises(ValueError, match="--max_lora_rank needs --backend engine"):
        RolloutServerConfig(max_lora_rank=16, backend="hf")
    with pytest.raises(ValueError, match="--max_lora_rank must be >= 0"):
        RolloutServerConfig(max_lora_rank=-1)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_drain_timeout_s_is_positive(value):
    with pytest.raises(ValueError, match="--drain_timeout_s must be > 0"):
        RolloutServerConfig(drain_timeout_s=value)


@pytest.mark.parametrize("value", [0, -1])
def test_max_pending_requests_admits_at_least_one(value):
    """0 was taken, and the server then answered every request 503 'retry later' for good."""
    with pytest.raises(ValueError, match="--max_pending_requests must be >= 1"):
        RolloutServerConfig(max_pending_requests=value)
