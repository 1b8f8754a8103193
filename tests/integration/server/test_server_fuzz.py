"""Fuzz the server's OpenAPI schema (schemathesis + hypothesis): no request answers 5xx and the server
stays healthy. Bounded: a fixed number of examples per operation, derandomized.

Excluded, on purpose: /sleep (it would hold every later request), /wake, and /weights/* (the trainer's
side of weight sync: a random rendezvous address only tests the network's timeout).
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
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


# Each sampling field at and past its edges; every one either serves or is a 4xx, never a 5xx.
SAMPLING_EXTREMES = [
    {"top_k": 10**20}, {"top_k": 1e20}, {"top_k": 2**31}, {"top_k": 2**31 - 1}, {"top_k": 0}, {"top_k": -2},
    {"temperature": 1e308}, {"temperature": 1e-300}, {"temperature": 100.0}, {"temperature": -0.0},
    {"top_p": 1e-300}, {"top_p": 1.0000001}, {"min_p": 1.0}, {"min_p": 1e-300},
    {"max_tokens": 2**63}, {"max_tokens": 0}, {"seed": 2**64}, {"seed": -1}, {"seed": 2**63 - 1},
    {"stop": ["x" * 5000]}, {"stop": [""]}, {"stop_token_ids": [2**62, -(2**62)]},
]


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_sampling_field_extremes_are_served_or_refused_alone_never_failing_a_neighbour(server, route):
    """A request at any sampling extreme runs beside good requests in the same engine steps: it is
    answered (4xx when illegal) and every good request still completes."""
    good = {"prompt": "neighbour", "max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for extreme in SAMPLING_EXTREMES:
            neighbours = [pool.submit(httpx.post, server.url + "/generate", json={**good, "seed": i}, timeout=60) for i in range(4)]
            body = {"prompt": "edge", "max_tokens": 4, **extreme}
            answer = httpx.post(server.url + route, json=body, timeout=60)
            assert answer.status_code < 500, f"{extreme}: {answer.status_code} {answer.text[:300]}"
            for future in neighbours:
                response = future.result()
                assert response.status_code == 200, f"neighbour of {extreme}: {response.text[:300]}"
                assert response.json()["results"][0]["finish_reason"] == "length", f"neighbour of {extreme}"
