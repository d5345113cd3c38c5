"""/metrics speaks vLLM's names, types and labels, so a vLLM dashboard reads this server unchanged."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL, Served

# Every vLLM metric the project supports, with its Prometheus type (as parsed: counters drop `_total`).
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    # The server speculates (tests/server/conftest.py), so these exist too.
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
}


def test_metrics_have_vllm_names_types_and_labels(server: Served):
    r = server.http().post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    assert {name: families[name].type for name in VLLM_METRICS if name in families} == VLLM_METRICS
    for name in VLLM_METRICS:
        for sample in families[name].samples:
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0", sample
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert "length" in reasons
    info = families["vllm:cache_config_info"].samples[0].labels
    assert int(info["num_gpu_blocks"]) > 0 and info["block_size"] == "16"
    assert all(name.startswith(("vllm:", "deepseek:")) for name in families)
