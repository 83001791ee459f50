"""Errors shared by every layer (so lower layers need not import the engine to raise them)."""


class InvalidRequestError(ValueError):
    """A request qv cannot run as given; the message names the field and the limit (HTTP 400)."""
