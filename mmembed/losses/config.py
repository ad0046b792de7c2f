"""InfoNCE settings, and the one place where mmembed reads the ``INFONCE_*`` variables.

ms-swift configures its InfoNCE loss through the environment rather than the command
line; mmembed keeps that contract so existing launch scripts work unchanged. The
variables are parsed here, once, into an :class:`InfoNCEConfig` that the rest of the
package passes around explicitly.

=============================  ===========  ==========================================
variable                       default      meaning
=============================  ===========  ==========================================
``INFONCE_TEMPERATURE``        ``0.1``      logits are similarities divided by this
``INFONCE_USE_BATCH``          ``true``     every document of the batch is a candidate
``INFONCE_HARD_NEGATIVES``     unset        negatives kept (or sampled up to) per group
``INFONCE_MASK_FAKE_NEGATIVE`` ``false``    drop candidates scoring above the positive
``INFONCE_FAKE_NEG_MARGIN``    ``0.1``      ... by more than this margin
``INFONCE_INCLUDE_QQ``         ``false``    other anchors are candidates too
``INFONCE_INCLUDE_DD``         ``false``    add the positive-vs-documents block
=============================  ===========  ==========================================

Booleans are ``true``/``false`` or ``1``/``0`` in any case. A variable set to an empty
string counts as unset.

The same settings given as values (a ``--dataset_config`` dataset's ``infonce`` mapping, keyed
by field or variable name) are read by :meth:`InfoNCEConfig.from_values` /
:func:`infonce_values`, with the variables' checks and messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..data.dataset_config import ConfigError
from ..environment import EnvironmentLike, InfoNCEVariables, read
from .base import MIN_TEMPERATURE_TEXT, check_temperature, finite_number

#: the InfoNCE settings: field name -> its ``INFONCE_*`` variable; either name is a key of a
#: ``--dataset_config`` dataset's ``infonce`` mapping
INFONCE_KEYS: dict[str, str] = {
    "temperature": "INFONCE_TEMPERATURE",
    "use_batch": "INFONCE_USE_BATCH",
    "hard_negatives": "INFONCE_HARD_NEGATIVES",
    "mask_fake_negative": "INFONCE_MASK_FAKE_NEGATIVE",
    "fake_neg_margin": "INFONCE_FAKE_NEG_MARGIN",
    "include_qq": "INFONCE_INCLUDE_QQ",
    "include_dd": "INFONCE_INCLUDE_DD",
}

#: the INFONCE_* variables by field name (the same table)
ENV_VARS: dict[str, str] = INFONCE_KEYS

# what each variable allows, for the message when a value does not parse
ALLOWED: dict[str, str] = {
    "temperature": f"a number >= {MIN_TEMPERATURE_TEXT} (default 0.1)",
    "hard_negatives": "an integer >= 1, or unset to use every negative",
    "fake_neg_margin": "a finite number (default 0.1)",
}

_TRUE = {"true", "1"}
_FALSE = {"false", "0"}


@dataclass(frozen=True)
class InfoNCEConfig:
    """Settings of :class:`mmembed.losses.InfoNCELoss`, with ms-swift's defaults.

    Args:
        temperature: Similarities are divided by this before the softmax. Must be at least
            :data:`~mmembed.losses.base.MIN_TEMPERATURE` (below it float32 logits saturate:
            loss and gradient exactly 0).
        use_batch: If True, every positive and negative of the batch is a candidate
            for every anchor; if False, each anchor only sees its own group.
        hard_negatives: If set, each group keeps its first ``hard_negatives``
            negatives, or is filled up to that many by sampling its own negatives with
            replacement. Must be >= 1. ``None`` uses every negative as given.
        mask_fake_negative: If True (and ``use_batch``), a query-document or
            query-query similarity greater than the anchor's positive similarity plus
            ``fake_neg_margin`` is removed from the softmax.
        fake_neg_margin: The margin used by ``mask_fake_negative``.
        include_qq: If True (and ``use_batch``), the other anchors are candidates too.
        include_dd: If True (and ``use_batch``), append the similarities of the
            anchor's positive to every other document.

    Example:
        ::

            from mmembed.losses import InfoNCEConfig

            config = InfoNCEConfig.from_env()              # what ms-swift would use
            config = InfoNCEConfig.from_env(temperature=0.05)  # one value overridden
    """

    temperature: float = 0.1
    use_batch: bool = True
    hard_negatives: int | None = None
    mask_fake_negative: bool = False
    fake_neg_margin: float = 0.1
    include_qq: bool = False
    include_dd: bool = False

    def __post_init__(self) -> None:
        for name in ("use_batch", "mask_fake_negative", "include_qq", "include_dd"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"InfoNCE option {name} must be a bool, got {value!r}")
        finite_number("InfoNCE", "fake_neg_margin", self.fake_neg_margin)
        if isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool) and self.temperature <= 0:
            raise ValueError(f"InfoNCE temperature must be > 0, got {self.temperature!r}")
        check_temperature("InfoNCE", "temperature", self.temperature)
        hn = self.hard_negatives
        if hn is not None and (isinstance(hn, bool) or not isinstance(hn, int) or hn < 1):
            raise ValueError(f"InfoNCE hard_negatives must be an integer >= 1 or None, got {hn!r}")

    @classmethod
    def from_env(cls, environ: EnvironmentLike = None, **overrides: Any) -> InfoNCEConfig:
        """Read the ``INFONCE_*`` variables, as ms-swift does when it builds the loss.

        Args:
            environ: Where to read the variables; ``os.environ`` when None (a mapping, or an
                :class:`~mmembed.environment.Environment` a command read at its start).
            **overrides: Field values that win over the environment. A variable whose
                field is overridden is not read, so a bad value there is not an error.

        Returns:
            A validated config. Unset (or empty) variables take the defaults above.

        Raises:
            ValueError: A variable that does not parse, naming it and its value, or a
                value out of range (temperature <= 0 or too small for float32, hard
                negatives < 1), or an
                override that is not a field.
        """
        return cls.from_variables(read(environ).infonce, **overrides)

    @classmethod
    def from_variables(cls, variables: InfoNCEVariables, **overrides: Any) -> InfoNCEConfig:
        """:meth:`from_env` on the ``INFONCE_*`` variables as :mod:`mmembed.environment` read them."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown InfoNCE option(s) {unknown}; known: {sorted(names)}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in overrides:
                values[f.name] = overrides[f.name]
                continue
            var = ENV_VARS[f.name]
            raw = variables.get(var)
            if raw is None or raw.strip() == "":
                continue
            value = _parse(var, raw.strip(), f.default, ALLOWED.get(f.name, ""))
            try:
                cls(**{f.name: value})  # range checks, reported against the variable
            except ValueError as exc:
                raise ValueError(f"{var}={raw!r}: {exc}") from None
            values[f.name] = value
        return cls(**values)

    @classmethod
    def from_values(cls, values: Mapping[str, Any], file: str | None = None,
                    dataset: str | None = None) -> InfoNCEConfig:
        """A config from settings given as values (:func:`infonce_values`: keys are field or
        ``INFONCE_*`` names, each value checked as its variable would be); the fields not given
        take their defaults (the ``INFONCE_*`` variables are not read).

        Raises:
            ConfigError: with ``file`` (a ``--dataset_config`` file), naming it, ``dataset`` and
                the key; ValueError naming the key otherwise.
        """
        return cls(**infonce_values(values, file, dataset))


def infonce_keys(values: Mapping[str, Any], file: str | None = None, dataset: str | None = None) -> dict[str, Any]:
    """``values`` (InfoNCE settings, a ``--dataset_config`` dataset's ``infonce`` mapping) keyed
    by field name: each key is a field name or its variable's (:data:`INFONCE_KEYS`), not both.

    Raises:
        ConfigError: with ``file``: naming the file, ``dataset`` and the key (``infonce.<key>``).
        ValueError: without ``file``: naming the key.
    """
    by_var = {var: name for name, var in INFONCE_KEYS.items()}
    out: dict[str, Any] = {}
    for key, raw in values.items():
        name = key if key in INFONCE_KEYS else by_var.get(key)
        if name is None:
            raise _error(file, dataset, key, f"not an InfoNCE setting; known: {', '.join(INFONCE_KEYS)} (or their "
                                             "INFONCE_* names)")
        if name in out:
            raise _error(file, dataset, key, f"given twice ({name} and {INFONCE_KEYS[name]})")
        out[name] = raw
    return out


def infonce_values(values: Mapping[str, Any], file: str | None = None, dataset: str | None = None) -> dict[str, Any]:
    """The :class:`InfoNCEConfig` fields that ``values`` gives (keys as :func:`infonce_keys`
    takes them), each parsed from its value rather than from text.

    A value is read as the variable's text would be: a boolean field takes true/false or 1/0,
    ``hard_negatives`` an integer, the others a number; a string is parsed as the variable's
    text; None (or an empty string) gives the field's default (the variable unset). Errors name
    the variable and the value as its text, as :meth:`InfoNCEConfig.from_env` does.

    Raises:
        ConfigError: with ``file``: naming the file, ``dataset`` and the key (``infonce.<key>``).
        ValueError: without ``file``: naming the key.
    """
    if not isinstance(values, Mapping):
        reason = f"must be a mapping of InfoNCE settings, got {values!r}"
        raise ConfigError(file, dataset, "infonce", reason) if file is not None else ValueError(f"InfoNCE settings {reason}")
    for key, raw in values.items():
        if raw is not None and not isinstance(raw, (bool, int, float, str)):
            raise _error(file, dataset, key, f"must be a number, a boolean or null, got {raw!r}")
    defaults = {f.name: f.default for f in fields(InfoNCEConfig)}
    out: dict[str, Any] = {}
    for name, raw in infonce_keys(values, file, dataset).items():
        try:
            out[name] = _value(name, raw, defaults[name])
        except ValueError as e:
            raise _error(file, dataset, name, str(e)) from None
    return out


def _error(file: str | None, dataset: str | None, key: Any, reason: str) -> ValueError:
    if file is not None:
        return ConfigError(file, dataset, f"infonce.{key}", reason)
    return ValueError(f"InfoNCE setting {key!r}: {reason}")


def _value(name: str, raw: bool | int | float | str | None, default: Any) -> Any:
    """One setting's value: ``raw`` checked as its variable's text would be (the text in messages)."""
    var = INFONCE_KEYS[name]
    text = "" if raw is None else ("true" if raw else "false") if isinstance(raw, bool) else str(raw)
    if text.strip() == "":
        return default
    allowed = ALLOWED.get(name, "")
    if isinstance(raw, str):
        value = _parse(var, text.strip(), default, allowed)
    elif isinstance(default, bool):
        if isinstance(raw, float) or raw not in (0, 1):  # (True and False are 1 and 0)
            raise ValueError(f"{var}={text!r} is not a boolean; use true/false or 1/0")
        value = bool(raw)
    elif default is None:  # hard_negatives: an integer
        if isinstance(raw, (bool, float)):
            raise ValueError(f"{var}={text!r} is not an integer; use {allowed}")
        value = raw
    else:
        if isinstance(raw, bool):
            raise ValueError(f"{var}={text!r} is not a number; use {allowed}")
        value = float(raw) if abs(raw) < 1e308 else float(text)  # (an integer too large for a float: inf, as its text)
    try:
        InfoNCEConfig(**{name: value})  # range checks, reported against the variable
    except ValueError as exc:
        raise ValueError(f"{var}={text!r}: {exc}") from None
    return value


def _parse(var: str, raw: str, default: Any, allowed: str) -> Any:
    """Parse one variable's text into the type of its field's default."""
    if isinstance(default, bool):
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"{var}={raw!r} is not a boolean; use true/false or 1/0")
    if default is None:  # hard_negatives: an integer
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{var}={raw!r} is not an integer; use {allowed}") from None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not a number; use {allowed}") from None


def env_temperature(default: float, environ: EnvironmentLike = None) -> float:
    """``INFONCE_TEMPERATURE`` when it is set (parsed and validated as for InfoNCE, so a bad
    value is an error naming the variable), else ``default``: for losses other than InfoNCE
    that share the variable."""
    variables = read(environ).infonce
    raw = variables.get(ENV_VARS["temperature"])
    if raw is None or raw.strip() == "":
        return default
    others = {f.name: f.default for f in fields(InfoNCEConfig) if f.name != "temperature"}
    return InfoNCEConfig.from_variables(variables, **others).temperature
