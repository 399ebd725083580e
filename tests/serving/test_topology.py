"""Topology files: every shipped one starts and serves; a broken one names the field."""

import httpx
import pytest

from serving.cli import parser, topology_from
from serving.managers.scheduler import resolve_device
from serving.runtime.specs import scheduler_config
from serving.runtime.topology import CONFIGS, TopologyError, load_topology, parse_size

from ..conftest import free_tcp_port
from .test_http import start_server

SHIPPED = ["default", "multi-worker", "single-process", "tcp"]  # multi-worker serves in test_workers.py


def test_every_shipped_topology_validates():
    assert sorted(path.stem for path in CONFIGS.glob("*.yaml")) == SHIPPED
    for name in SHIPPED:
        load_topology(name).check()


@pytest.mark.slow  # each starts the topology's child processes
@pytest.mark.parametrize("name", ["default", "tcp"])
async def test_shipped_topology_starts_and_serves(nursery, name):
    overrides = {}
    if name == "tcp":  # the file's fixed ports may be taken on a test machine
        overrides = {"actors.scheduler": {"process": "child", "address": f"tcp://127.0.0.1:{free_tcp_port()}"},
                     "actors.detokenizer": {"process": "child", "address": f"tcp://127.0.0.1:{free_tcp_port()}"},
                     "actors.tokenizer": {"process": "main", "address": f"tcp://127.0.0.1:{free_tcp_port()}"}}
    url, _ = await start_server(nursery, name, **overrides)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        assert (await client.get("/health")).status_code == 200
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def write(tmp_path, text):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("scheduler:\n  page_size: many\n", r"t.yaml:2: scheduler.page_size: Expected `int`, got `str`"),
        ("model:\n  path: null\nserver:\n  prot: 80\n", r"t.yaml:4: server.prot: unknown field"),
        ("scheduler:\n  kv_budget: lots\n", r"t.yaml:2: scheduler.kv_budget: 'lots' is not a size"),
        ("scheduler:\n  stream_interval: 0\n", r"scheduler.stream_interval: must be in 1..1024"),
        ("scheduler:\n  stream_interval: 5000\n", r"scheduler.stream_interval: must be in 1..1024"),
        ("actors:\n  scheduler: {process: child, address: 'inproc://s'}\n", r"t.yaml:2: actors.scheduler: a child process"),
        # the default's scheduler (a child) sends to a detokenizer in main that only inproc:// would reach
        ("actors:\n  scheduler: {process: child, address: 'ipc:///tmp/s'}\n"
         "  detokenizer: {process: main, address: 'inproc://detokenizer'}\n",
         r"t.yaml:3: actors.detokenizer.address: inproc://detokenizer cannot be reached from actors.scheduler"),
        ("actors:\n  scheduler: {process: main, address: 'inproc://s'}\n"
         "  detokenizer: {process: child, address: 'ipc:///tmp/d'}\n",
         r"actors.scheduler.address: inproc://s cannot be reached from actors.detokenizer in another process"),
        ("supervision:\n  strategy: one_for_some\n", r"t.yaml:2: supervision.strategy: Invalid enum value"),
        ("supervision:\n  start: sideways\n", r"t.yaml:2: supervision.start: Invalid enum value 'sideways'"),
        ("model:\n  device: gpu\n", r"t.yaml:2: model.device: Expected `str` matching regex"),
        ("actors:\n  scheduler: {process: child, address: 'tcp://10.1.2.3:5000'}\n",
         r"t.yaml:2: actors.scheduler.address: tcp://10.1.2.3:5000 is not a loopback address"),
        ("actors:\n  detokenizer: {process: child, address: 'tcp://0.0.0.0:5000'}\n",
         r"t.yaml:2: actors.detokenizer.address: tcp://0.0.0.0:5000 is not a loopback address"),
        ("transport:\n  curve: {secret_file: /no/such.key_secret}\n", r"t.yaml:2: transport.curve: "),
        ("transport:\n  max_message_bytes: huge\n", r"t.yaml:2: transport.max_message_bytes: 'huge' is not a size"),
        ("server: [1, 2\n", r"not valid YAML"),
        ("- 1\n", r"top level must be a mapping"),
    ],
)
def test_a_broken_file_names_the_field_and_line(tmp_path, text, expected):
    with pytest.raises(TopologyError) as info:
        load_topology(write(tmp_path, text))
    assert expected in str(info.value), str(info.value)


def test_flags_override_the_file():
    args = parser().parse_args(["serve", "--config", "default", "--device", "cpu", "--dtype", "float32",
                                "--port", "8123", "--max-running-requests", "7"])
    topology = topology_from(args)
    assert topology.model.device == "cpu" and topology.model.dtype == "float32"
    assert topology.server.port == 8123 and topology.scheduler.max_running_requests == 7
    assert scheduler_config(topology, "inproc://d").device == "cpu"
    assert load_topology("default").model.device == "auto"
    with pytest.raises(TopologyError, match="model.device"):
        topology_from(parser().parse_args(["serve", "--device", "tpu"]))


def test_auto_device_is_cuda_only_when_torch_sees_a_gpu():
    import torch

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("cpu") == "cpu"


async def test_device_and_context_length_reach_the_scheduler_and_v1_models(nursery, tiny_loaded):
    config = tiny_loaded.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2  # bf16 K and V
    url, _ = await start_server(nursery, **{"model.device": "cpu", "scheduler.kv_budget": per_token * 300})
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        info = (await client.get("/server_info")).json()
        assert info["device"] == "cpu" and info["scheduler"]["device"] == "cpu"
        capacity = info["kv_pages_total"] * info["kv_page_size"]
        assert capacity < config.max_position_embeddings  # the KV pool is the bound here
        assert info["max_context_len"] == capacity
        model = (await client.get("/v1/models")).json()["data"][0]
        assert model["max_model_len"] == capacity
        r = await client.post("/generate", json={"input_ids": [5] * capacity, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and f"the context window is {capacity} tokens" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "sampling_params.max_new_tokens"
        r = await client.post("/v1/completions", json={"prompt": [5] * (capacity - 2), "max_tokens": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        r = await client.post("/v1/completions", json={"prompt": [5] * (capacity - 2), "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_remote_tcp_address_is_allowed_with_curve_or_when_insecure_is_asked_for(tmp_path):
    remote = ("actors:\n  scheduler: {process: child, address: 'tcp://10.1.2.3:5000'}\n"
              "  detokenizer: {process: child, address: 'ipc:///tmp/d'}\n  tokenizer: {address: 'ipc:///tmp/t'}\n")
    assert load_topology(write(tmp_path, remote + "transport: {allow_insecure: true}\n")).transport.allow_insecure
    curve = load_topology(write(tmp_path, remote + "transport: {curve: {generate: true}}\n"))
    assert curve.hub_options().curve is not None
    assert load_topology(write(tmp_path, "actors:\n  scheduler: {address: 'tcp://[::1]:5000'}\n"))


@pytest.mark.slow  # starts child processes linked over tcp with CURVE
async def test_tcp_links_with_generated_curve_keys_serve(nursery):
    """Every link over tcp with CURVE: the child processes get the keys with their hub options."""
    tcp = {name: {"process": "child" if name != "tokenizer" else "main",
                  "address": f"tcp://127.0.0.1:{free_tcp_port()}"} for name in ("scheduler", "detokenizer", "tokenizer")}
    url, app = await start_server(nursery, "tcp", **{f"actors.{k}": v for k, v in tcp.items()},
                                  **{"transport.curve": {"generate": True}})
    assert app.state.server.runtime.supervisor is not None
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        info = (await client.get("/server_info")).json()
        assert info["topology"]["transport"]["curve"] == "***"  # key material is never shown


def test_missing_file_lists_the_shipped_ones():
    with pytest.raises(TopologyError, match="single-process"):
        load_topology("no-such-topology")


def test_sizes():
    assert parse_size("256MiB", "x") == 256 * 2**20
    assert parse_size("1.5GB", "x") == 1_500_000_000
    assert parse_size(1024, "x") == 1024


def test_child_processes_get_the_configured_start_and_load_timeouts_and_the_scheduler_the_weight_roots(tmp_path):
    """Issue 29 N12: a child has watchdogs.start_timeout (120 s) to bind its mailbox, and the scheduler
    watchdogs.load_timeout (1800 s) from then to load the model (a large model or a GGUF's first
    conversion). N13a: the scheduler gets the weight roots, resolved, to check an update itself."""
    from types import SimpleNamespace

    from serving.runtime.specs import core_specs

    topology = load_topology("default", {"model.path": "tiny", "watchdogs.start_timeout": 1234.0,
                                         "watchdogs.load_timeout": 4321.0,
                                         "server.weights_roots": [str(tmp_path / "w" / "..")]})
    default = load_topology("default").watchdogs
    assert (default.start_timeout, default.load_timeout) == (120.0, 1800.0)
    addresses = topology.addresses(tmp_path)
    specs = core_specs(topology, addresses, [addresses["tokenizer"]], SimpleNamespace(options=None), None,
                       lambda: "tiny")
    children = {spec.name: spec.start() for spec in specs}
    assert {name: (child.ready_timeout, child.load_timeout) for name, child in children.items()} == \
        {"scheduler": (1234.0, 4321.0), "detokenizer": (1234.0, 4321.0)}
    assert children["scheduler"].args["config"]["weights_roots"] == [str(tmp_path.resolve())]
    with pytest.raises(TopologyError, match="watchdogs.start_timeout"):
        load_topology("default", {"watchdogs.start_timeout": 0})
    with pytest.raises(TopologyError, match="watchdogs.load_timeout"):
        load_topology("default", {"watchdogs.load_timeout": -1})


def test_activations_flag_reaches_the_scheduler_and_int8_on_cuda_is_refused_naming_the_field():
    topology = topology_from(parser().parse_args(["serve", "--activations", "int8"]))
    assert topology.model.activations == "int8"
    assert scheduler_config(topology, "inproc://d").activations == "int8"
    assert load_topology("default").model.activations == "exact"
    assert scheduler_config(load_topology("default"), "inproc://d").activations == "exact"
    with pytest.raises(TopologyError, match="model.activations: int8 runs on CPU only"):
        topology_from(parser().parse_args(["serve", "--activations", "int8", "--device", "cuda"]))
    with pytest.raises(SystemExit):  # argparse: not a choice
        parser().parse_args(["serve", "--activations", "int4"])
