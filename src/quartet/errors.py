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


class OutputError(QuartetError):
    """An output that could not be written (disk full, over quota, a read-only or refusing filesystem). `path` is
    the output it names; what was there before is unchanged (quartet.atomic writes nothing in place)."""

    def __init__(self, path, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"cannot write {self.path}: {reason}; what was there before is unchanged")
