"""motet: a Mixture-of-Experts LLM inference engine — actors on Trio, model code in JAX.

    from motet import Engine
    async with Engine() as engine:          # the default model
        answer = await engine.chat([{"role": "user", "content": "Hi"}])
    answer.text                             # the reply; answer.stats: its figures

The engines and errors are imported on first use, so `import motet.model` (the pure JAX
layer) does not start Trio or the actors.
"""

from importlib import import_module

__version__ = "0.1.0"

# name -> the module that defines it
_FACE = {
    "Engine": "motet.engines.engine",
    "MuxEngine": "motet.engines.mux_engine",
    "SplitEngine": "motet.engines.split",
    "RestartingEngine": "motet.engines.restarting",
    "EngineAPI": "motet.runtime.engine_api",
    "load_model": "motet.model",
    "EngineError": "motet.runtime.errors",
    "BadRequest": "motet.runtime.errors",
    "EmptyPrompt": "motet.runtime.errors",
    "SlotBusy": "motet.runtime.errors",
    "DuplicateId": "motet.runtime.errors",
    "ContextExceeded": "motet.runtime.errors",
    "QueueFull": "motet.runtime.errors",
    "NotFound": "motet.runtime.errors",
    "Cancelled": "motet.runtime.errors",
    "EngineClosed": "motet.runtime.errors",
    "EngineUnavailable": "motet.runtime.errors",
    "ModelError": "motet.model.errors",
    "ModelFileError": "motet.model.errors",
    "UnsupportedModelError": "motet.model.errors",
    "SessionError": "motet.protocol.session_file",
}
__all__ = ["__version__", *_FACE]


def __getattr__(name: str):
    if name not in _FACE:
        raise AttributeError(f"module 'motet' has no attribute {name!r}")
    value = getattr(import_module(_FACE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
