"""Gateway-routable metrics (issue 32): /metrics carries the scheduler's queue, running and KV-usage
gauges under SGLang's and vLLM's names too, with tercet's own values, and the front end's pods carry
the label an InferencePool's endpoint picker chooses its metric names by."""

import httpx
import trio
import yaml

from serving.http.metrics import ALIASES

from ..conftest import ROOT
from .test_http import start_server


def samples(text):
    """{name: value} of the unlabelled samples of a Prometheus page."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_metrics_carry_sglang_and_vllm_names_with_tercets_values(nursery):
    url, _ = await start_server(nursery)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def scrape():
            with trio.fail_after(30):  # the figures come from the health probe's first answer
                while "tercet_num_queue_reqs" not in (page := samples((await client.get("/metrics")).text)):
                    await trio.sleep(0.05)
            return page

        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        assert (await client.post("/generate", json=body)).status_code == 200
        page = await scrape()
    for own, names in ALIASES.items():
        for name in names:
            assert page[name] == page[own], (name, own)
    assert {"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage",
            "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:gpu_cache_usage_perc"} <= set(page)
    assert 0.0 <= page["sglang:token_usage"] <= 1.0


def test_the_pods_that_serve_http_say_which_engine_they_are():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "frontend.yaml").read_text()))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["inference.networking.k8s.io/engine-type"] == "sglang"
    assert "docs/gateway.md" in (ROOT / "README.md").read_text()
