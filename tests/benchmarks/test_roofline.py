"""benchmarks/roofline.py: the machine's figures, the bytes and FLOPs per token of a model as it is
loaded (dense fp32 and bf16, oneDNN's packed layout, tercet's panels, GGUF block codes, MoE
experts), and a result beside its two bounds."""

import pytest
import torch

from benchmarks import roofline
from models import cpu_kernels
from models.layers import CausalLM
from models.loading import tiny_config, tiny_model
from models.projections import PackedLinear

CONTEXT = 100


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def projection_params(state_dict) -> int:
    """Weights of every projection and the LM head, counted off the checkpoint itself."""
    return sum(t.numel() for name, t in state_dict.items()
               if name.endswith("_proj.weight") or name == "lm_head.weight")


def model(loaded, dtype=torch.float32, **how):
    return CausalLM(loaded.config, loaded.state_dict, dtype, packed=how.pop("packed", False),
                    kernel=how.pop("kernel", False), **how)


def kernels():
    if not (cpu_kernels.load() and cpu_kernels.packed_linear_available()):
        pytest.skip("tercet's fp32 kernel is not built on this machine")


@pytest.mark.parametrize("dtype,size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_dense_projections_read_their_parameters_times_the_element_size(tiny, dtype, size):
    config = tiny.config
    costs = roofline.model_costs(model(tiny, dtype), CONTEXT)
    params = projection_params(tiny.state_dict)
    assert params == 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128) + 49152 * 64  # the tiny config's shapes
    assert costs.params == params
    assert costs.weight_bytes == costs.held_bytes == size * params
    assert costs.storage == {f"DenseLinear {str(dtype)[6:]}": {"count": 9, "params": params, "bytes": size * params}}
    kv_width = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    assert costs.kv_bytes == 2 * config.num_hidden_layers * kv_width * size * CONTEXT
    assert costs.embed_bytes == config.hidden_size * size
    assert costs.bytes_per_token(1) == size * params + costs.kv_bytes + costs.embed_bytes
    assert costs.bytes_per_token(4) == size * params / 4 + costs.kv_bytes + costs.embed_bytes
    attention = 4 * config.hidden_size * CONTEXT * config.num_hidden_layers  # q . k and p . v, every head
    assert costs.flops == 2 * params + attention and costs.attention_flops == attention
    assert costs.compute == ("bf16" if dtype == torch.bfloat16 else "fp32")


def test_tercets_fp32_panels_hold_exactly_the_weights_here(tiny):
    kernels()  # every shape of the tiny model is a whole number of 16-column panels: no padding
    costs = roofline.model_costs(model(tiny, kernel=True, codes=False), CONTEXT)
    params = projection_params(tiny.state_dict)
    assert list(costs.storage) == ["PanelLinear float32"]
    assert costs.weight_bytes == 4 * params


def test_a_plain_weight_kept_beside_the_packed_one_is_held_but_not_read():
    weight = torch.randn(48, 64)
    assert roofline.projection_bytes(PackedLinear(weight, keep_dense=True)) == (4 * 48 * 64, 8 * 48 * 64)
    assert roofline.projection_bytes(PackedLinear(weight, torch.zeros(48))) == (4 * 48 * 65, 4 * 48 * 65)


def test_bf16_panels_kept_beside_block_codes_are_held_but_not_read():
    """(Bf16BlockCodeLinear's layout: a decoded token reads the codes; the panels serve larger products.)"""
    from types import SimpleNamespace

    proj = SimpleNamespace(codes=[torch.zeros(96, dtype=torch.uint8), torch.zeros(8)], panels=torch.zeros(
        64, dtype=torch.bfloat16), bias=torch.zeros(4), out_features=4)
    assert roofline.projection_bytes(proj) == (96 + 32 + 16, 96 + 32 + 128 + 16)


def gguf_model(loaded):
    """The tiny model with every projection quantized to Q4_1 and dequantized, as a GGUF loads."""
    from gguf import GGMLQuantizationType, quants

    q4_1 = GGMLQuantizationType.Q4_1
    state_dict = dict(loaded.state_dict)
    for name, t in state_dict.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            state_dict[name] = torch.from_numpy(quants.dequantize(quants.quantize(t.numpy(), q4_1), q4_1).copy())
    return CausalLM(loaded.config, state_dict, torch.float32, packed=False, kernel=True, codes=True)


def storage_bytes(obj) -> int:
    """Bytes of the distinct storages under an object's attributes (another count than numel x size)."""
    seen = {}
    stack = list(vars(obj).values())
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return sum(seen.values())


def test_block_codes_are_counted_as_what_they_store(tiny):
    kernels()
    lm = gguf_model(tiny)
    costs = roofline.model_costs(lm, CONTEXT)
    params = projection_params(tiny.state_dict)
    assert [name.split()[0] for name in costs.storage] == ["BlockCodeLinear"]
    assert costs.weight_bytes == sum(storage_bytes(p) for p in lm.projections())
    # Q4_1: 4-bit codes and a d, m per 32 weights; at most one int8 per code and fp32 d, m (1.25
    # bytes a weight), at least the nibbles (0.5)
    assert 0.5 * params < costs.weight_bytes <= 1.25 * params
    assert costs.params == params and costs.flops == 2 * params + costs.attention_flops


def test_a_moe_token_multiplies_its_router_and_top_k_experts():
    loaded = tiny_model(tiny_config("mixtral", num_local_experts=8, intermediate_size=32, num_experts_per_tok=2,
                                    sliding_window=None))
    costs = roofline.model_costs(model(loaded), CONTEXT)
    hidden, width, layers = 64, 32, 2
    expert = 3 * width * hidden  # gate, up and down
    attention = hidden * (64 + 32 + 32) + hidden * hidden
    head = 49152 * hidden
    assert costs.experts == 8 and costs.top_k == 2
    assert costs.params == layers * (attention + 8 * hidden + 2 * expert) + head
    assert costs.expert_bytes == 4 * layers * 8 * expert
    assert costs.weight_bytes == 4 * (layers * (attention + 8 * hidden) + head)
    # a step of one row reads its 2 experts of 8 on average; of many rows, nearly all of them
    assert costs.weights_read(1) == pytest.approx(costs.weight_bytes + costs.expert_bytes * 2 / 8)
    assert costs.weights_read(1000) == pytest.approx(costs.weight_bytes + costs.expert_bytes)


def test_batch_one_binds_on_bandwidth_and_large_batches_on_compute(tiny):
    costs = roofline.model_costs(model(tiny), CONTEXT)
    machine = roofline.Machine(bandwidth=20e9, gemm_peak={"fp32": 150e9}, threads=2, flags=["avx2"],
                               bandwidth_bytes=256 << 20, gemm_size=2048)
    one = roofline.bound_row(100.0, costs, machine, batch=1)
    assert one["bandwidth_bound_tok_s"] == round(20e9 / costs.bytes_per_token(1), 1)
    assert one["compute_bound_tok_s"] == round(150e9 / costs.flops, 1)
    assert one["binds"] == "bandwidth"
    assert one["pct_of_bound"] == one["pct_of_bandwidth_bound"] == round(100 * 100.0 / (20e9 / costs.bytes_per_token(1)), 1)
    many = roofline.bound_row(100.0, costs, machine, batch=4096)
    assert many["binds"] == "compute" and many["pct_of_bound"] == many["pct_of_compute_bound"]
    # a prompt's FLOPs spread over the tokens decoded after it lower the compute bound
    prompted = roofline.bound_row(100.0, costs, machine, batch=4096, prompt_tokens=64, output_tokens=8)
    assert prompted["flops_per_token"] == round(costs.flops + costs.prefill_flops(64) / 8)
    assert prompted["compute_bound_tok_s"] < many["compute_bound_tok_s"]
    cells = roofline.bound_cells(one)
    assert len(cells) == len(roofline.BOUND_HEAD) and cells.split()[2] == "bw"


def test_prefill_attention_counts_the_triangle_and_a_window():
    assert roofline._triangle(4, None) == 1 + 2 + 3 + 4
    assert roofline._triangle(5, 2) == 1 + 2 + 2 + 2 + 2


def test_the_machine_is_measured_in_small_sizes_for_a_smoke_run():
    assert roofline.measure_bandwidth(1 << 20, repeats=1) > 0
    assert roofline.measure_gemm_peak(torch.float32, size=64, repeats=1) > 0
    machine = roofline.measure_machine(smoke=True)
    assert machine.bandwidth > 0 and machine.gemm_peak["fp32"] > 0
    assert ("bf16" in machine.gemm_peak) == roofline.has_bf16_units()
    assert "GB/s" in machine.describe()


def test_the_fp32_peak_is_the_faster_of_torch_and_tercets_kernel(monkeypatch):
    """A bound below what the runner reaches is no bound (torch's MKL made 57 GFLOP/s on an EPYC, tercet's
    kernel 101-130 on SmolLM2's projections)."""
    monkeypatch.setattr(roofline, "measure_gemm_peak", lambda dtype, size, repeats: 1e9)
    monkeypatch.setattr(roofline, "measure_kernel_gemm_peak", lambda size, repeats: 2e9)
    machine = roofline.measure_machine(smoke=True)
    assert machine.gemm_peak["fp32"] == 2e9 and machine.gemm_by["fp32"] == "tercet"
    assert "fp32 2 (tercet)" in machine.describe()
    monkeypatch.setattr(roofline, "measure_kernel_gemm_peak", lambda size, repeats: None)  # no kernel here
    machine = roofline.measure_machine(smoke=True)
    assert machine.gemm_peak["fp32"] == 1e9 and machine.gemm_by["fp32"] == "torch"


def test_tercets_kernel_is_timed_on_the_square_product():
    from models import cpu_kernels

    peak = roofline.measure_kernel_gemm_peak(size=64, repeats=1)
    assert (peak is not None and peak > 0) == cpu_kernels.packed_linear_available()
