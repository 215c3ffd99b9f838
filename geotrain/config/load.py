"""Reading config files: YAML plus ``KEY=VALUE`` overrides, validated into a section model.

Override values are parsed as YAML scalars, so ``sync.algorithm=ddp`` and ``optim.lr=1e-3`` both
do what one expects, and may reach into defaults (``topology.sites.0.workers=4``); a section
with a ``name`` is set by its name alone (``sync.codec=int8``) or key by key (``sync.codec.fraction=0.02``). The first
validation error becomes one line naming the field: ``field.path: message (got value)``. The
YAML loader also reads ``1e9`` as a float (YAML 1.1 would make it a string). Shared by the
training config and the planner/simulator scenarios, so every file geotrain reads has the
same rules.
"""

from __future__ import annotations

import contextlib
import copy
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from geotrain.config.base import submodel
from geotrain.config.root import Config
from geotrain.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e9`` as a float (YAML 1.1 insists on ``1.0e+9``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$|^[-+]?\d[\d_]*\.\d*$|^[-+]?\.\d+$"),
    list("-+0123456789."),
)


def _parse_scalar(text: str) -> Any:
    return yaml.load(text, Loader=_Loader) if text.strip() else ""


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: no such list element in override '{key}'")
            node = node[int(part)]
            continue
        if part not in node or node[part] is None:
            node[part] = {}
        if isinstance(node[part], str):  # a section given by its name (sync.codec: topk), now set key by key
            node[part] = {"name": node[part]}
        node = node[part]
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a section, cannot set '{key}'")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"{key}: no such list element")
        node[int(last)] = value
    elif isinstance(value, str) and isinstance(node.get(last), dict) and "name" in node[last]:
        node[last] = {**node[last], "name": value}  # a section set by its name: its other keys stay
    else:
        node[last] = value


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, recursively for mappings; anything else in ``top`` replaces."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _loc_to_str(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "config"


def _allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = submodel(field.annotation)
        if model is None:
            return []
    return sorted(getattr(model, "model_fields", {}))


def format_error(err: ValidationError, root: type[BaseModel]) -> str:
    """The first validation error as one line: ``field.path: message (got value)``; a key that
    moved (``root.moved_keys``) is named with its new key first."""
    errors = err.errors(include_url=False)
    moved: dict[str, str] = getattr(root, "moved_keys", {})
    for e in errors:
        if e["type"] == "extra_forbidden" and _loc_to_str(tuple(e["loc"])) in moved:
            old = _loc_to_str(tuple(e["loc"]))
            return f"{old}: moved to {moved[old]}"
    e = errors[0]
    loc = tuple(e["loc"])
    field = _loc_to_str(loc)
    if e["type"] == "extra_forbidden":
        allowed = _allowed_keys(root, loc)
        hint = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
        return f"{field}: unknown key{hint}"
    msg = e["msg"].removeprefix("Value error, ")
    named = re.match(r"([A-Za-z_][A-Za-z0-9_.\[\]]*): (.*)", msg)
    if e["type"] == "value_error" and named and named.group(1).split(".")[0].split("[")[0] in _allowed_keys(root, (*loc, "")):
        # a cross-field check that names its field: report it at that field
        return f"{_loc_to_str((*loc, named.group(1)))}: {named.group(2)}"
    if "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
        return f"{field}: {msg} (got {e['input']!r})"
    return f"{field}: {msg}"


def load_yaml_model(root: type[M], path: str | Path | None, overrides: list[str] | None = None, option: str = "--config") -> M:
    """Validate ``root`` from an optional YAML file plus ``KEY=VALUE`` overrides.

    Shared by training configs and the planner/simulator scenarios, so every file geotrain reads
    has the same rules: strict types, unknown keys refused, one-line errors naming the field.

    Raises:
        ConfigError: with a one-line message naming the offending field.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{option}: file not found: {path}")
        try:
            loaded = yaml.load(p.read_text(), Loader=_Loader)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{option}: not valid YAML: {str(exc).splitlines()[0]}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{option}: the file must hold a mapping of sections ({', '.join(root.model_fields)})")
        data = loaded
    return model_from_data(root, data, overrides)


def model_from_data(root: type[M], data: dict[str, Any], overrides: list[str] | None = None) -> M:
    """Validate ``root`` from ``data`` (a mapping of sections, left unchanged) plus ``KEY=VALUE``
    overrides, with :func:`load_yaml_model`'s rules and one-line errors."""
    data = copy.deepcopy(data)
    if overrides:  # so an override can reach into defaults, e.g. topology.sites.0.workers=4
        with contextlib.suppress(ValidationError):  # a root with required keys: overrides apply to the file only
            data = _merge(root().model_dump(), data)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set: expected KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        if not key or not re.fullmatch(r"[A-Za-z0-9_.]+", key):
            raise ConfigError(f"--set: bad key {key!r}")
        try:
            parsed = _parse_scalar(value)
        except yaml.YAMLError:
            raise ConfigError(f"{key}: cannot parse value {value!r}") from None
        _set_dotted(data, key, parsed)
    try:
        return root.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_error(exc, root)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a training config from an optional YAML file plus ``KEY=VALUE`` overrides.

    Raises:
        ConfigError: with a one-line message naming the offending field.
    """
    return load_yaml_model(Config, path, overrides)
