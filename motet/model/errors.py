"""Errors raised while loading or running a model. Each says what and where."""


class ModelError(Exception):
    """Base class: a model could not be loaded or a request cannot run on it."""


class ModelFileError(ModelError):
    """A model path is missing, unreadable, truncated or of an unknown format."""


class UnsupportedModelError(ModelError):
    """The architecture, quantization or a config feature is not supported."""


class ContextLengthError(ModelError):
    """A prompt does not fit in the context."""

    def __init__(self, used: int, limit: int):
        super().__init__(f"prompt of {used} tokens exceeds the context of {limit} tokens")
        self.used = used
        self.limit = limit
