"""Strict validation of a Serve config (a serveConfigV2 string or `serve_schema_dict` output).

Ray's `ServeDeploySchema` ignores unknown keys in deployments, actor options and autoscaling configs, so a
typo like `num_replcas` would deploy with defaults; `unknown_keys` walks the same pydantic models and
reports them. The application `args` are checked by our own `ServeConfig` (extra="forbid").
"""

from __future__ import annotations

import types
import typing
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from ray.serve.schema import ServeDeploySchema

from core.config import CHECK_FILES, ServeConfig


def _model_arms(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The pydantic model inside an annotation (through Optional / Union / List), and whether it is a list."""
    origin = typing.get_origin(annotation)
    if origin in (list, typing.List):  # noqa: UP006 - Ray annotates with typing.List
        inner, _ = _model_arms(typing.get_args(annotation)[0])
        return inner, True
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(annotation):
            inner, is_list = _model_arms(arm)
            if inner is not None:
                return inner, is_list
        return None, False
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


def unknown_keys(model: type[BaseModel], data: Any, path: str = "") -> list[str]:
    """Dotted paths of keys in `data` that `model` (recursively) has no field for."""
    if not isinstance(data, dict):
        return []
    found = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        where = f"{path}.{key}" if path else key
        if field is None:
            found.append(where)
            continue
        inner, is_list = _model_arms(field.annotation)
        if inner is None:
            continue
        items = value if is_list and isinstance(value, list) else [value]
        for index, item in enumerate(items):
            found += unknown_keys(inner, item, f"{where}[{index}]" if is_list else where)
    return found


def serve_config_errors(config: dict[str, Any]) -> list[str]:
    """Problems with a Serve config dict: Ray's schema, unknown keys, and each app's args as a ServeConfig."""
    errors = [f"unknown Serve config key: {path}" for path in unknown_keys(ServeDeploySchema, config)]
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as exc:
        errors.append(f"ServeDeploySchema: {exc}")
    for app in config.get("applications") or []:
        try:
            ServeConfig.model_validate(app.get("args") or {}, context={CHECK_FILES: False})  # files: in the pods
        except ValidationError as exc:
            errors.append(f"application {app.get('name')!r} args are not a ServeConfig: {exc}")
    return errors


def parse_serve_config_v2(text: str) -> dict[str, Any]:
    """A RayService's serveConfigV2 string as a dict (it must be a YAML mapping)."""
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError("serveConfigV2 must be a YAML mapping")
    return data
