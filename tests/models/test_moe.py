"""The sparse MoE block (models.moe): transformers' results, and a row's bits whatever the batch.

- against transformers' own blocks (Qwen3-MoE with and without `norm_topk_prob`, Mixtral) on
  random weights, fp32;
- a row alone vs beside 1, 7 or 63 other rows: the same bits, in fp32 and bf16, on each path a
  projection may take in the deterministic mode (tercet's kernel, oneDNN from two rows on, fixed
  row tiles); the control shows plain `F.linear` products would not hold it;
- checkpoints' per-expert weights fused as transformers holds them.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from models import cpu_kernels, invariant, probes
from models.moe import SparseMoE, fuse_experts, is_sparse, sparse_moe
from models.projections import Linear
from models.runner import SeqInput
from tests.models.test_determinism import assert_same, make_runner, pin, random_ids, run  # noqa: F401 (pin: a fixture)

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


# -- whole models, loaded from what transformers saves -------------------------------------------------

# small enough for seconds; random weights of std 0.15, so greedy tokens are far from ties
MODELS = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, head_dim=16,
                      num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, intermediate_size=32, num_hidden_layers=2, sliding_window=None),
}
STD = 0.15


def save_tiny_moe(model_type, directory, seed=0):
    """A random model of `model_type` as transformers saves it (safetensors, per-expert weights),
    with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM

    from models.loading import load_tokenizer, tiny_config

    config = tiny_config(model_type, num_experts_per_tok=2, **MODELS[model_type])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, STD)
    model.save_pretrained(directory)
    load_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe_dir(request, tmp_path_factory):
    return save_tiny_moe(request.param, tmp_path_factory.mktemp(request.param))


def hf_from(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def test_a_saved_model_gives_transformers_logprobs_and_greedy_tokens(moe_dir, hf_greedy):
    from models.loading import load_model
    from models.runner import ModelRunner, SeqInput, generate

    loaded = load_model(moe_dir)
    hf = hf_from(moe_dir)
    runner = ModelRunner(loaded, dtype=torch.float32, kv_budget_bytes=8 << 20)
    rnd = random.Random(0)
    for n in (5, 23):
        prompt = [rnd.randrange(3, 49000) for _ in range(n)]
        want = hf_greedy(hf, prompt, 16)
        assert len(want) == 16  # (the random model has no reason to stop)
        assert generate(runner, [prompt], 16) == [want]
        tokens = prompt + want  # teacher-forced: every position's logprobs
        pages = runner.kv.allocate(runner.kv.pages_for(len(tokens)))
        ours = runner.logits([SeqInput(tokens, pages, sample=False)], [0])[0].log_softmax(-1)
        runner.kv.free(pages)
        with torch.inference_mode():
            theirs = hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
        assert (ours - theirs).abs().max().item() < 2e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_saved_model_runs_in_the_deterministic_mode_by_default(moe_dir, dtype):
    from models.loading import load_model
    from models.runner import ModelRunner

    loaded = load_model(moe_dir)
    runner = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=8 << 20)
    sparse = [i for i, layer in enumerate(runner.model.layers) if isinstance(layer.mlp, SparseMoE)]
    assert sparse == [i for i in range(loaded.config.num_hidden_layers) if is_sparse(loaded.config, i)]
    assert sparse != [] and (loaded.config.model_type != "qwen3_moe" or len(sparse) < len(runner.model.layers))
    experts = [lin for i in sparse for lin in runner.model.layers[i].mlp.projections()]
    assert len(experts) == len(sparse) * (1 + 2 * 8)  # the router, each expert's gate/up and down
    projections = runner.model.projections()
    assert runner.deterministic and all(any(lin is p for p in projections) for lin in experts)
    assert sum(runner.model.invariant_paths.values()) == len(projections)  # experts made invariant too


# -- the deterministic mode's properties on an MoE model (tests/models/test_determinism.py's) ----------

MODE_PATHS = [
    pytest.param(torch.float32, "kernel", id="fp32-kernel"),
    pytest.param(torch.bfloat16, "kernel", id="bf16-kernel"),
    pytest.param(torch.bfloat16, "tiles", id="bf16-tiles"),
]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """Qwen3-MoE with a dense layer among its sparse ones (`mlp_only_layers`)."""
    from models.loading import load_model

    return load_model(save_tiny_moe("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), seed=1))


@pytest.mark.parametrize("dtype,path", MODE_PATHS)
@pytest.mark.parametrize("others", [1, 7, 63])
def test_moe_a_batch_around_a_sequence_does_not_change_it(qwen3_moe, pin, dtype, path, others):
    runner = make_runner(pin(dtype, path, qwen3_moe), dtype, path)
    rnd = random.Random(others)
    prompt = random_ids(rnd, 21)
    assert_same(run(runner, prompt, 5, others=others, rnd=rnd), run(runner, prompt, 5))


@pytest.mark.parametrize("dtype,path", MODE_PATHS)
def test_moe_a_cached_prefix_and_chunked_prefill_give_what_one_prefill_gives(qwen3_moe, pin, dtype, path):
    runner = make_runner(pin(dtype, path, qwen3_moe), dtype, path, page_size=16)
    rnd = random.Random(2)
    prompt = random_ids(rnd, 40)
    logits, ids, logprobs = whole = run(runner, prompt, 4)
    for chunk in (1, 7, 64):
        assert_same(run(runner, prompt, 4, chunk=chunk), whole)
    donor_pages = runner.kv.allocate(3)  # another request filled the first 32 tokens' pages
    runner.step([SeqInput(prompt[:32] + random_ids(rnd, 9), donor_pages)])
    own = runner.kv.allocate(runner.kv.pages_for(len(prompt) + 4) - 2)
    got = run(runner, prompt, 4, pages=donor_pages[:2] + own, cached=32, chunk=7, others=3, rnd=rnd)
    assert_same(got, (logits[32:], ids, logprobs))
    runner.kv.free(donor_pages)
    runner.kv.free(own)


@pytest.mark.parametrize("dtype,path", MODE_PATHS)
def test_moe_re_prefilling_generated_tokens_gives_what_decoding_gave(qwen3_moe, pin, dtype, path):
    runner = make_runner(pin(dtype, path, qwen3_moe), dtype, path)
    prompt = random_ids(random.Random(4), 13)
    logits, ids, logprobs = run(runner, prompt, 8)
    for k in (1, 4, 7):  # a restart after k generated tokens: prefill prompt + ids[:k]
        assert_same(run(runner, prompt + ids[:k], 8 - k), (logits, ids[k:], logprobs[k:]))
