"""One exception family for everything a user can get wrong.

Every message is a single line that names the file, row and field (or config key) at fault.
The CLI prints ``error: <message>`` and exits 2; no traceback reaches the user.
"""


class QuartetError(Exception):
    """A user-facing error: one line, says what and where."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class ConfigError(QuartetError):
    """A bad config value, an unknown key, a missing required field."""


class DataError(QuartetError):
    """A dataset file or row that cannot be used."""


class ModelError(QuartetError):
    """A model name, directory, GGUF file or tokenizer that cannot be used."""
