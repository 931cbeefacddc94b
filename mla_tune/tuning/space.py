"""Parameter spaces: the knobs a backend exposes, declared as data in `configs/backends/`.

A stored config is only ever *data*: it is validated against the declared space before any
backend sees it, so a shared tuning DB cannot make a process run anything unexpected.
"""

from __future__ import annotations

import functools
import itertools
import json
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mla_tune.configs

CONFIG_DIR = Path(mla_tune.configs.__file__).resolve().parent
"""configs/ of the repository, installed as the package mla_tune.configs."""

Scalar = int | float | str | bool


class ConfigError(ValueError):
    """A config that is not a point of its backend's declared space."""


@dataclass(frozen=True)
class ParamSpace:
    """Ordered discrete choices per parameter; the grid is their product."""

    params: tuple[tuple[str, tuple[Scalar, ...]], ...]
    defaults: tuple[tuple[str, Scalar], ...] = ()
    """Values of knobs a stored config may lack (stored before the knob existed):
    `validate` fills them in, so an old config and the point spelling its default out
    are one config, with one key."""

    def with_defaults(self, defaults: Mapping[str, Scalar]) -> "ParamSpace":
        """This space, taking `defaults` for those of its knobs a config lacks."""
        names = set(self.names)
        return ParamSpace(self.params, tuple(sorted(
            (k, v) for k, v in defaults.items() if k in names)))

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "ParamSpace":
        items = []
        for name, choices in m.items():
            values = tuple(choices) if isinstance(choices, (list, tuple)) else (choices,)
            if not values:
                raise ConfigError(f"parameter {name!r} has no choices")
            for v in values:
                if not isinstance(v, (int, float, str, bool)):
                    raise ConfigError(f"parameter {name!r}: choice {v!r} is not a scalar")
            items.append((name, values))
        return cls(tuple(items))

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.params]

    def choices(self, name: str) -> tuple[Scalar, ...]:
        for n, values in self.params:
            if n == name:
                return values
        raise KeyError(name)

    def grid(self) -> Iterator[dict[str, Scalar]]:
        """Every point, in declaration order (first parameter varies slowest)."""
        names = self.names
        for combo in itertools.product(*(v for _, v in self.params)):
            yield dict(zip(names, combo))

    def size(self) -> int:
        n = 1
        for _, v in self.params:
            n *= len(v)
        return n

    def validate(self, config: Mapping[str, Any]) -> dict[str, Scalar]:
        """Return `config` if it is a point of this space, else raise ConfigError."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"config must be a mapping, got {type(config).__name__}")
        unknown = set(config) - set(self.names)
        if unknown:
            raise ConfigError(f"unknown parameter(s) {sorted(unknown)}; space has {self.names}")
        config = {**{k: v for k, v in self.defaults if k not in config}, **config}
        missing = set(self.names) - set(config)
        if missing:
            raise ConfigError(f"missing parameter(s) {sorted(missing)}")
        out: dict[str, Scalar] = {}
        for name, values in self.params:
            v = config[name]
            if type(v) is float and v.is_integer() and any(type(c) is int for c in values):
                v = int(v)
            if not any(type(v) is type(c) and v == c for c in values):
                raise ConfigError(f"{name}={v!r} is not one of {list(values)}")
            out[name] = v
        return out

    def restrict(self, fixed: Mapping[str, Any]) -> "ParamSpace":
        """Narrow some parameters to a value or a list of values (each a declared choice)."""
        unknown = set(fixed) - set(self.names)
        if unknown:
            raise ConfigError(f"unknown parameter(s) {sorted(unknown)}; space has {self.names}")
        items = []
        for name, values in self.params:
            if name in fixed:
                wanted = fixed[name] if isinstance(fixed[name], (list, tuple)) else [fixed[name]]
                for v in wanted:
                    if v not in values:
                        raise ConfigError(f"{name}={v!r} is not one of {list(values)}")
                items.append((name, tuple(v for v in values if v in wanted)))
            else:
                items.append((name, values))
        return ParamSpace(tuple(items), self.defaults)


def parse_pin(text: str) -> tuple[str, str, list[Scalar]]:
    """Parse `backend.knob=v1,v2` (values as TOML scalars or bare words) into its parts."""
    head, sep, values = text.partition("=")
    backend, dot, knob = head.strip().partition(".")
    if not (sep and dot and backend and knob and values.strip()):
        raise ConfigError(f"bad pin {text!r}: expected BACKEND.KNOB=VALUE[,VALUE...], "
                          "e.g. triton.num_splits=1,4")
    parsed: list[Scalar] = []
    for raw in values.split(","):
        raw = raw.strip()
        try:
            parsed.append(tomllib.loads(f"v = {raw}")["v"])
        except tomllib.TOMLDecodeError:
            parsed.append(raw)
    return backend, knob.strip(), parsed


def config_key(config: Mapping[str, Any]) -> str:
    """Canonical JSON text of a config: equal configs give equal keys."""
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"))


def load_toml(relpath: str) -> dict[str, Any]:
    """Read a TOML file under `configs/`."""
    path = CONFIG_DIR / relpath
    with path.open("rb") as f:
        return tomllib.load(f)


@functools.cache
def load_backend_space(backend: str, device_type: str = "cuda") -> ParamSpace:
    """The declared space of a backend: `[space]`, with `[space.<device_type>]` lists
    replacing the defaults for that device type (e.g. a smaller grid on CPU). Read once per
    process: spaces are package data, and the dispatcher and feasibility checks ask often."""
    data = load_toml(f"backends/{backend}.toml")
    space = dict(data.get("space", {}))
    per_device = {k: v for k, v in space.items() if isinstance(v, dict)}
    base = {k: v for k, v in space.items() if not isinstance(v, dict)}
    base.update(per_device.get(device_type, {}))
    return ParamSpace.from_mapping(base)
