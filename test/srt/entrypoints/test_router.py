"""Data parallelism through the real sglang-router (`sglang-router` from PyPI): two workers of
this fork behind `python -m sglang_router.launch_router`, and the router's own
`python -m sglang_router.launch_server --dp-size 2`, which imports our ServerArgs and
launch_server unchanged. Loopback only."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

pytestmark = pytest.mark.slow  # server and router processes

pytest.importorskip("sglang_router")

WORKER_ARGS = ["--max-total-tokens", "8192", "--skip-server-warmup"]
DOC = " ".join(f"Clause {i}: the supplier shall deliver the goods listed in schedule {i % 7} "
               "within thirty days of the order." for i in range(24))


@pytest.fixture(scope="module")
def workers(start_server, tiny_llama_dir):
    return [start_server(tiny_llama_dir, WORKER_ARGS) for _ in range(2)]


@pytest.fixture(scope="module")
def router(start_router, workers):
    return start_router("launch_router", [
        "--worker-urls", *[w.base_url for w in workers], "--policy", "cache_aware",
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
        "--retry-max-retries", "3", "--log-level", "warn"])


def test_same_document_questions_land_on_one_worker(router, workers):
    """Cache-aware routing keeps a document's questions on the worker that holds its
    prefix: the second question's prompt is served from that worker's radix cache."""
    for w in workers:
        w.post("/flush_cache")
    for doc_id in range(3):
        doc = f"Contract {doc_id}. " + DOC
        first = router.generate(doc + " Question: when is delivery due?")
        second = router.generate(doc + " Question: who delivers the goods?")
        assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
        assert second.json()["meta_info"]["cached_tokens"] > 100, second.json()["meta_info"]
    # and the OpenAI API passes through the router unchanged
    import openai

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    out = client.completions.create(model=workers[0].internal_state()["served_model_name"],
                                    prompt=DOC, max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3 and out.choices[0].text


def test_router_reads_every_workers_load(router, workers):
    """The router's /get_loads asks each worker's /get_load and reads its KV tokens in use
    (`num_tokens`): 0 when idle, the running request's tokens while one decodes."""
    import threading

    def loads():
        out = requests.get(router.url + "/get_loads", timeout=30).json()["workers"]
        return {entry["worker"]: entry["load"] for entry in out}

    assert loads() == {w.base_url: 0 for w in workers}
    busy = workers[1]
    long = threading.Thread(target=lambda: busy.post("/generate", json={
        "text": DOC, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}))
    long.start()
    seen = []
    while long.is_alive() and len(seen) < 20:
        seen.append(loads()[busy.base_url])
    long.join()
    assert max(seen) > 100, seen  # the prompt's tokens and more, as the worker reported
    for w in workers:
        w.assert_all_slots_free()


def test_killed_worker_is_dropped_and_requests_keep_succeeding(router, workers):
    """The router's health check (every second here) marks a killed worker unhealthy and
    routes around it. (Requests it sent to the worker before that fail: the router does not
    retry a refused connection on another worker.)"""
    victim, survivor = workers
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(30)
    deadline = time.time() + 30
    while time.time() < deadline:
        health = {w["url"]: w["is_healthy"]
                  for w in requests.get(router.url + "/workers", timeout=10).json()["workers"]}
        if not health.get(victim.base_url, False):
            break
        time.sleep(0.2)
    assert health == {victim.base_url: False, survivor.base_url: True}, health
    codes = [router.generate(f"Question {i}: " + DOC[:200]).status_code for i in range(8)]
    assert codes == [200] * 8, (codes, router.log()[-3000:])
    survivor.assert_all_slots_free()


def test_router_launch_server_starts_dp_replicas_of_this_fork(start_router, tiny_llama_dir):
    """`python -m sglang_router.launch_server --dp-size 2` builds our ServerArgs from the
    same flags and runs our launch_server in each replica, as it does upstream's."""
    r = start_router("launch_server", [
        "--model-path", tiny_llama_dir, "--dtype", "float32", "--dp-size", "2", *WORKER_ARGS,
        "--router-dp-worker-base-port", str(20000 + os.getpid() % 20000)])
    # the router answers once one replica is up; the other may register a little later
    # (seconds while the rest of the suite loads the two cores)
    deadline = time.time() + 120
    while True:
        replicas = requests.get(r.url + "/workers", timeout=30).json()["workers"]
        if (len(replicas) == 2 and all(w["is_healthy"] for w in replicas)
                or time.time() > deadline):
            break
        time.sleep(0.5)
    assert len(replicas) == 2 and all(w["is_healthy"] for w in replicas), replicas
    outs = [r.generate(f"Request {i}: " + DOC[:300]) for i in range(4)]
    assert all(o.status_code == 200 for o in outs), [o.text for o in outs]
    for w in replicas:  # each replica is one of ours, started by the router's launcher
        info = requests.get(w["url"] + "/server_info", timeout=30).json()
        assert info["dp_size"] == 1 and info["max_total_num_tokens"] == 8192, info
