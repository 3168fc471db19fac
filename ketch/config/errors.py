"""The error of a configuration that cannot run (shared by the loader and the checks)."""


class ConfigError(ValueError):
    """A configuration that cannot run: the message names the key, the value and the fix."""


def raise_problems(problems: list[str]) -> None:
    """Raise one `ConfigError` listing `problems` (one line each), if there are any."""
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
