"""`tandem rollout --model tandem:tiny` as a user tries it offline, through the official `openai` client:
the served name, and `/metrics` scraped and parsed as Prometheus would."""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rollout_helpers import BACKENDS, start_server

SERVED = "tiny-policy"


@pytest.fixture(scope="module")
def tiny_server():
    s = start_server("tandem:tiny", "--served_model_name", SERVED, backend=BACKENDS[-1])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_built_in_model_serves_under_its_served_name(oai, tiny_server):
    generator = "engine" if BACKENDS[-1] == "engine" else "transformers generate"
    assert tiny_server.first_line.startswith(f"tandem rollout: serving tandem:tiny (generator: {generator}) on http://")
    assert [m.id for m in oai.models.list().data] == [SERVED]
    answer = oai.completions.create(model=SERVED, prompt="digits:", max_tokens=4, extra_body={"ignore_eos": True})
    assert answer.model == SERVED and answer.usage.completion_tokens == 4


def test_metrics_are_prometheus_text_with_help_and_type(tiny_server, oai):
    args = dict(model=SERVED, prompt="lowercase:", max_tokens=5, extra_body={"ignore_eos": True})
    oai.completions.create(**args)
    assert len([chunk for chunk in oai.completions.create(**args, stream=True)]) > 1
    text = tiny_server.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "tandem_request_latency_seconds": "histogram",
        "tandem_time_to_first_token_seconds": "histogram",
        "tandem_weight_sync_seconds": "histogram",
        "tandem_requests": "counter",
        "tandem_generated_tokens": "counter",
        "tandem_generated_tokens_per_second": "gauge",
        "tandem_requests_queued": "gauge",
        "tandem_requests_running": "gauge",
        "tandem_policy_version": "gauge",
        "tandem_weight_syncs": "counter",
    }
    if BACKENDS[-1] == "engine":
        expected |= {"tandem_kv_cache_usage_ratio": "gauge", "tandem_preemptions": "counter"}
    for name, kind in expected.items():
        assert families[name].type == kind and families[name].documentation, name
        exposed = name + "_total" if kind == "counter" else name
        assert f"# HELP {exposed} " in text and f"# TYPE {exposed} {kind}" in text
    values = tiny_server.metrics()
    assert values["tandem_request_latency_seconds_count"] >= 2 and values["tandem_time_to_first_token_seconds_count"] >= 1
    assert values["tandem_generated_tokens_total"] >= 10 and values["tandem_generated_tokens_per_second"] > 0
    assert values["tandem_requests_queued"] == 0 and values["tandem_policy_version"] == 0
    assert values["tandem_weight_sync_seconds_count"] == 0 and values["process_resident_memory_bytes"] > 0
    if BACKENDS[-1] == "engine":
        assert 0 <= values["tandem_kv_cache_usage_ratio"] <= 1 and values["tandem_preemptions_total"] >= 0
