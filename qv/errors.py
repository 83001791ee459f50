"""Errors shared by every layer (so lower layers need not import the engine to raise them)."""


class ConfigError(ValueError):
    """A checkpoint config or a lever value that qv cannot use; the message names the cause."""


class InvalidRequestError(ValueError):
    """A request qv cannot run as given; the message names the field and the limit (HTTP 400)."""


class StartupError(RuntimeError):
    """The engine cannot start as configured; the message says why and which lever changes that
    (`qv serve` prints it and exits non-zero)."""


class MediaError(InvalidRequestError):
    """An image or video qv cannot take: a request error (the server answers 400 with the message)."""


class LoraError(InvalidRequestError):
    """A LoRA adapter qv cannot load or find; the message names it and the cause (HTTP 400 / 404).
    Here, not in qv/engine/lora_rows.py, so the server's LoRA routes import no torch."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
