"""The one exception type for bad user input in configs (exit code 2, one line, no traceback)."""


class ConfigError(ValueError):
    """A configuration a user wrote is unknown, mistyped or impossible. The message is one line
    naming the key(s) and the rule."""
