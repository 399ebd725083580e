"""The sparse MoE block (models.moe): transformers' results, and a row's bits whatever the batch.

- against transformers' own blocks (Qwen3-MoE with and without `norm_topk_prob`, Mixtral) on
  random weights, fp32;
- a row alone vs beside 1, 7 or 63 other rows: the same bits, in fp32 and bf16, on each path a
  projection may take in the deterministic mode (tercet's kernel, oneDNN from two rows on, fixed
  row tiles); the control shows plain `F.linear` products would not hold it;
- checkpoints' per-expert weights fused as transformers holds them.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from models import cpu_kernels, invariant, probes
from models.moe import SparseMoE, fuse_experts, is_sparse, sparse_moe
from models.projections import Linear

CPU = torch.device("cpu")
HIDDEN, EXPERT_WIDTH, EXPERTS, TOP_K = 64, 32, 8, 2


def moe_config(model_type, **overrides):
    experts = {"qwen3_moe": dict(num_experts=EXPERTS, moe_intermediate_size=EXPERT_WIDTH),
               "mixtral": dict(num_local_experts=EXPERTS, intermediate_size=EXPERT_WIDTH)}[model_type]
    fields = dict(hidden_size=HIDDEN, num_experts_per_tok=TOP_K, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, **experts)
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def transformers_block(config, seed=0):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = {"qwen3_moe": Qwen3MoeSparseMoeBlock, "mixtral": MixtralSparseMoeBlock}[config.model_type](config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return block.eval()


def silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return invariant.silu(gate) * up


def ours(block, config, linear=Linear, dtype=torch.float32):
    weights = {f"mlp.{name}": p.detach().to(dtype) for name, p in block.state_dict().items()}
    return sparse_moe(weights.__getitem__, "mlp", config, linear, silu_mul,
                      normalize=getattr(config, "norm_topk_prob", True), round_weights=config.model_type != "mixtral")


CASES = [
    pytest.param("qwen3_moe", {"norm_topk_prob": True}, id="qwen3_moe-normalized"),
    pytest.param("qwen3_moe", {"norm_topk_prob": False}, id="qwen3_moe"),
    pytest.param("mixtral", {}, id="mixtral"),
]


@pytest.mark.parametrize("model_type,overrides", CASES)
@pytest.mark.parametrize("kernel", [False, True], ids=["f_linear", "kernel"])
def test_the_block_gives_transformers_results(model_type, overrides, kernel):
    if kernel and not cpu_kernels.packed_linear_available():
        pytest.skip("this build has no fp32 projection kernel")
    config = moe_config(model_type, **overrides)
    block = transformers_block(config)
    moe = ours(block, config, lambda w: Linear(w, kernel=kernel))
    h = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = block(h[None])[0]
        experts, weights = moe.route(h)
        _, hf_weights, hf_experts = block.gate(h)
        got = moe(h)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rows_are_routed_to_every_expert_and_to_k_distinct_ones():
    config = moe_config("mixtral")
    moe = ours(transformers_block(config), config)
    experts, weights = moe.route(torch.randn(200, HIDDEN, generator=torch.Generator().manual_seed(2)))
    assert experts.shape == (200, TOP_K) and set(experts.flatten().tolist()) == set(range(EXPERTS))
    assert (experts[:, 0] != experts[:, 1]).all()
    assert (weights[:, 0] >= weights[:, 1]).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(200))


def test_a_block_with_no_rows_gives_no_rows():
    config = moe_config("qwen3_moe")
    moe = ours(transformers_block(config), config)
    assert moe(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


# -- batch invariance --------------------------------------------------------------------------------

PATHS = ["kernel", "onednn", "tiles"]


def invariant_linear(path, dtype):
    """`Linear` as `CausalLM._make_invariant` leaves it on `path` (skips where this CPU lacks it)."""
    if path == "kernel" and not (cpu_kernels.packed_linear_available() if dtype == torch.float32
                                 else cpu_kernels.bf16_linear_available()):
        pytest.skip(f"no {dtype} projection kernel on this CPU")

    def linear(weight):
        if path == "kernel":
            lin = Linear(weight, kernel=True)
            assert lin.invariant_by_itself
        elif path == "onednn":
            if not probes.onednn_invariant(dtype, CPU, False, tuple(weight.shape)):
                pytest.skip(f"oneDNN's {dtype} products are not invariant on this CPU")
            lin = Linear(weight, packed=True)
            lin.min_rows = 2
        else:
            lin = Linear(weight)
            lin.tile = invariant.row_tile(dtype)
        return lin
    return linear


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", PATHS)
def test_a_row_has_the_same_bits_alone_or_in_a_batch(model_type, dtype, path):
    config = moe_config(model_type, norm_topk_prob=True)
    moe = ours(transformers_block(config), config, invariant_linear(path, dtype), dtype)
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(64, HIDDEN, generator=generator).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([moe(rows[i : i + 1]) for i in range(len(rows))])
        for others in (1, 7, 63):
            for at in (0, others // 2, others):  # the row first, inside, last
                batch = torch.cat([rows[1 : at + 1], rows[:1], rows[at + 1 : others + 1]])
                got = moe(batch)
                assert torch.equal(got[at], alone[0]), f"{others} others, the row at {at}"
                assert torch.equal(torch.cat([got[:at], got[at + 1 :]]), alone[1 : others + 1])


def test_control_plain_f_linear_experts_give_a_row_other_bits_in_a_batch():
    """fp32 `F.linear` rounds a row by the number of rows multiplied: the same block without the
    invariant products gives some row other bits beside 63 others than alone."""
    config = moe_config("mixtral", hidden_size=1536, intermediate_size=576)
    block = transformers_block(config)
    moe = SparseMoE(*_dense_parts(block), top_k=TOP_K, normalize=True, round_weights=False, act=silu_mul)
    rows = torch.randn(64, 1536, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        alone = torch.cat([moe(rows[i : i + 1]) for i in range(len(rows))])
        assert not torch.equal(moe(rows), alone)


def _dense_parts(block):
    class Plain:  # F.linear as it is: no padding, no tiles
        def __init__(self, weight):
            self.weight, self.out_features = weight, weight.shape[0]

        def __call__(self, x, upcast=False):
            return F.linear(x, self.weight)

    experts = block.experts
    return (Plain(block.gate.weight.detach()), [Plain(w) for w in experts.gate_up_proj.detach().unbind()],
            [Plain(w) for w in experts.down_proj.detach().unbind()])


# -- checkpoints ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_experts_saved_one_module_each_are_fused_as_transformers_holds_them(model_type, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = moe_config(model_type, num_hidden_layers=3, mlp_only_layers=[1], intermediate_size=48)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert any(".experts.0." in name for name in saved)  # the checkpoint's own layout
    fused = fuse_experts(saved)
    held = model.state_dict()
    assert sorted(fused) == sorted(held)
    assert all(torch.equal(fused[name], held[name]) for name in held)
    assert fuse_experts(held).keys() == held.keys()


def test_qwen3_moe_dense_layers_are_its_mlp_only_layers_and_those_off_its_sparse_step():
    config = moe_config("qwen3_moe", num_hidden_layers=6, mlp_only_layers=[3], decoder_sparse_step=2)
    assert [is_sparse(config, i) for i in range(6)] == [False, True, False, False, False, True]
    assert all(is_sparse(moe_config("mixtral"), i) for i in range(2))
