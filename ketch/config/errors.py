"""The error of a configuration that cannot run (shared by the loader and the checks)."""


class ConfigError(ValueError):
    """A configuration that cannot run: the message names the key, the value and the fix."""
