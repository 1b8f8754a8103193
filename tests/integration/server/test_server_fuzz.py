"""Fuzz the server's OpenAPI schema (schemathesis + hypothesis): no request answers 5xx and the server
stays healthy. Bounded: a fixed number of examples per operation, derandomized.

Excluded, on purpose: /sleep (it would hold every later request), /wake, and /weights/* (the trainer's
side of weight sync: a random rendezvous address only tests the network's timeout).
"""

from __future__ import annotations

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

EXAMPLES_PER_OPERATION = 25


def test_no_fuzzed_request_is_a_server_error_and_the_server_stays_healthy(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json").exclude(path_regex=r"^/(sleep|wake|weights)")
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /generate", "POST /generate_batch", "POST /collect", "POST /abort", "POST /v1/chat/completions"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def fuzz(case: schemathesis.Case) -> None:
            response = case.call(timeout=60)
            if response.status_code >= 500:
                failures.append(f"{operation.label} {response.status_code}: {str(case.body)[:200]} -> {response.text[:200]}")

        fuzz()
    assert not failures, "\n".join(failures[:10])
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    body = {"prompt": "still here", "max_tokens": 4, "temperature": 0}
    assert httpx.post(server.url + "/generate", json=body, timeout=60).status_code == 200
