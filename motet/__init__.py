"""motet: a Mixture-of-Experts LLM inference engine — actors on Trio, model code in JAX."""

from .model import load_model

__version__ = "0.1.0"
__all__ = ["__version__", "load_model"]
