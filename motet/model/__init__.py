"""Pure JAX model code: config, loaders, tokenizer, chat template, forward, sampling."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .errors import ContextLengthError, ModelError, ModelFileError, UnsupportedModelError
from .loader import default_model_path, load_model
from .model import Model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ContextLengthError",
    "Model",
    "ModelConfig",
    "ModelError",
    "ModelFileError",
    "UnsupportedModelError",
    "default_model_path",
    "load_model",
]
