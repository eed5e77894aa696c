"""The config checks' error and the three ways they raise it: a value, a condition, a combination."""


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key and the value it got."""


def fail(key: str, value: object, why: str) -> None:
    raise ConfigError(f"{key}={value!r}: {why}")


def check(ok: bool, key: str, value: object, why: str) -> None:
    if not ok:
        fail(key, value, why)


def refuse(when: bool, key: str, value: object, other: str, other_value: object, why: str) -> None:
    """A combination that makes no sense: the message names both keys and their values."""
    if when:
        fail(key, value, f"cannot be combined with {other}={other_value!r}: {why}")
