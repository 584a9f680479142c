"""The ``kvcmas.*`` settings: defaults, parsing from text, and reading them back from GGUF metadata."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .constants import KVCMAS_PREFIX, KVCMAS_SETTINGS, KVCMAS_SETTINGS_BY_KEY, KvcmasSetting
from .errors import ConvertError


def full_key(name: str) -> str:
    """``"rank_k"`` or ``"kvcmas.rank_k"`` -> ``"kvcmas.rank_k"``."""
    return name if name.startswith(KVCMAS_PREFIX) else KVCMAS_PREFIX + name


def _check(setting: KvcmasSetting, value: Any, origin: str) -> int | float | bool:
    """The value converted to the setting's type; ConvertError naming ``origin`` when it does not fit."""
    if setting.type == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConvertError(f"{origin}: {setting.key} must be a bool, got {value!r}")
    if setting.type == "uint32":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ConvertError(f"{origin}: {setting.key} must be an integer, got {value!r}")
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConvertError(f"{origin}: {setting.key} must be a finite number, got {value!r}")
        value = float(value)
    if (setting.minimum is not None and value < setting.minimum) or (
        setting.maximum is not None and value > setting.maximum
    ):
        raise ConvertError(f"{origin}: {setting.key} = {value} is outside [{setting.minimum}, {setting.maximum}]")
    return value


def parse_setting(name: str, text: str, origin: str = "argument") -> tuple[str, int | float | bool]:
    """Parses ``text`` for the setting ``name`` (with or without the ``kvcmas.`` prefix) into its typed value."""
    key = full_key(name)
    setting = KVCMAS_SETTINGS_BY_KEY.get(key)
    if setting is None:
        raise ConvertError(f"{origin}: unknown setting {key!r}; known: {', '.join(KVCMAS_SETTINGS_BY_KEY)}")
    t = text.strip().lower()
    value: Any
    try:
        if setting.type == "bool":
            if t not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(text)
            value = t in ("1", "true", "yes", "on")
        elif setting.type == "uint32":
            value = int(t, 0)
        else:
            value = float(t)
    except ValueError:
        raise ConvertError(f"{origin}: {key} = {text!r} is not a valid {setting.type}") from None
    return key, _check(setting, value, origin)


def default_settings() -> dict[str, int | float | bool]:
    """Every ``kvcmas.*`` key with its default value."""
    return {s.key: s.default for s in KVCMAS_SETTINGS}


def validate_settings(values: Mapping[str, Any], origin: str) -> dict[str, int | float | bool]:
    """Checks explicit ``kvcmas.*`` values (full keys) and returns them typed."""
    out: dict[str, int | float | bool] = {}
    for key, value in values.items():
        setting = KVCMAS_SETTINGS_BY_KEY.get(full_key(key))
        if setting is None:
            raise ConvertError(f"{origin}: unknown setting {key!r}; known: {', '.join(KVCMAS_SETTINGS_BY_KEY)}")
        out[setting.key] = _check(setting, value, origin)
    return out


def kvcmas_settings(metadata: Mapping[str, Any]) -> dict[str, int | float | bool]:
    """The KVCMAS correction settings of a model, from its GGUF metadata, with defaults for absent keys.

    Returns short names (``"rank_k"``, ``"gate_threshold"``, ...) mapped to int / float / bool. Keys under
    ``kvcmas.`` that this version does not know are ignored (a newer converter may add some); a known key with a
    wrong type or out-of-range value raises ConvertError (a ValueError).
    """
    out: dict[str, int | float | bool] = {}
    for s in KVCMAS_SETTINGS:
        value = metadata.get(s.key, s.default)
        out[s.key[len(KVCMAS_PREFIX) :]] = _check(s, value, "GGUF metadata")
    return out
