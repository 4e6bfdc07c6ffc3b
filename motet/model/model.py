"""`Model`: a loaded model's config, weights and tokenizer, with whole-sequence helpers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .chat_template import CHATML_TEMPLATE, render_chat
from .config import ACTIVATIONS, ModelConfig
from .constraint import GrammarCompiler
from .errors import ContextLengthError
from .expert_pool import ExpertReader
from .forward import prefill
from .kv import bucket
from .tokenizer import Tokenizer
from .weights import count_parameters, decode_bytes, is_quantized, weight_bytes, weight_formats


@dataclass
class Model:
    config: ModelConfig
    weights: dict
    tokenizer: Tokenizer
    path: Path
    dtype: str
    # Set when the experts were left in the model file (load_model(lazy_experts=True)):
    # they are read one by one into a tiered ExpertPool, and `weights` has none.
    expert_reader: ExpertReader | None = None
    # The KV cache's element type (runtime/kv_format.py); load_model picks it (kv.pick_kv_dtype).
    kv_dtype: str = "float32"

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """Compiles requests' grammars against this model's vocabulary (constraint.py)."""
        return GrammarCompiler(self.tokenizer, self.config.vocab_size)

    def with_settings(self, kv_dtype: str = "auto", activations: str | None = None) -> Model:
        """This model with another KV cache type ("auto": its own) or another rounding of
        x in its quantized products (None: its own), its weights shared."""
        model = self if kv_dtype == "auto" else replace(self, kv_dtype=kv_dtype)
        if activations is None:
            return model
        return replace(model, config=replace(model.config, x_bits=ACTIVATIONS[activations]))

    @property
    def experts_packed(self) -> bool:
        """Whether `weights` holds every expert (False: only a tiered runner can run it)."""
        return self.expert_reader is None or not self.config.is_moe

    @property
    def weight_format(self) -> str:
        """"quantized" when projections stay as the file quantized them, else the dtype:
        KV computed one way is not the KV of the other (sessions, process groups)."""
        return "quantized" if is_quantized(self.weights) else self.dtype

    @property
    def backend(self) -> str:
        """The platform its arrays live on ("cpu", "gpu"): KV computed on one is not
        the other's (session files say which)."""
        return jax.default_backend()

    @property
    def name(self) -> str:
        """The file's stem, or the directory's name for a Hugging Face directory."""
        return self.path.stem if self.path.is_file() else self.path.name

    @property
    def chat_template(self) -> str:
        return self.tokenizer.chat_template or CHATML_TEMPLATE

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """template_kwargs: more variables for the template (enable_thinking, ...)."""
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.tokenizer.bos_token or "",
            eos_token=self.tokenizer.eos_token or "",
            **template_kwargs,
        )

    def logits(self, token_ids) -> np.ndarray:
        """A full causal forward over the ids: float32 logits [len, vocab]."""
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        n = len(ids)
        if n == 0:
            raise ValueError("logits() needs at least one token")
        if not self.experts_packed:
            raise ValueError("this model's experts are tiered (lazy_experts): run it through a TieredModel")
        if n > self.config.max_context:
            raise ContextLengthError(n, self.config.max_context)
        padded = np.zeros(bucket(n), np.int32)
        padded[:n] = ids
        logits, _, _, _ = prefill(
            self.weights, [], [], jnp.asarray(padded), 0, 0, n,
            cfg=self.config, with_history=False, all_logits=True,
        )
        return np.asarray(logits[:n])

    def info(self) -> dict:
        cfg = self.config
        return {
            "architecture": cfg.arch,
            "path": str(self.path),
            "layers": cfg.n_layers,
            "hidden_size": cfg.hidden_size,
            "heads": cfg.n_heads,
            "kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "experts": cfg.n_experts,
            "experts_per_token": cfg.n_experts_per_tok,
            "moe_layers": sum(cfg.moe_layers),
            "vocab_size": cfg.vocab_size,
            "max_context": cfg.max_context,
            "parameters": count_parameters(self.weights) + self._unpacked_expert_parameters(),
            "weight_bytes": weight_bytes(self.weights),
            "decode_bytes": decode_bytes(cfg, self.weights),
            "dtype": self.dtype,
            "weights": self.weight_format,
            "kv_dtype": self.kv_dtype,
            "tensor_formats": weight_formats(self.weights),
        }

    def _unpacked_expert_parameters(self) -> int:
        if self.experts_packed:
            return 0
        cfg = self.config
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        return sum(cfg.moe_layers) * cfg.n_experts * per_expert
