"""YAML files parsed once into typed, validated objects; a bad file names its path, line and reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigFileError(Exception):
    """A configuration file is missing, is not valid YAML, or does not fit its schema."""

    def __init__(self, path: Path, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line else str(path)
        super().__init__(f"{where}: {reason}")


def load_yaml(path: Path, model: type[M], context: dict[str, Any] | None = None) -> M:
    """Parse `path` into `model`; `context` reaches the model's validators (e.g. known tier names)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigFileError(path, None, f"cannot read: {exc.strerror or exc}") from exc
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise ConfigFileError(path, line, f"not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    try:
        return model.model_validate(data if data is not None else {}, context=context)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        where = ".".join(str(p) for p in loc)
        reason = f"{where}: {err['msg']}" if where else err["msg"]
        raise ConfigFileError(path, _line_of(root, loc), reason) from exc


def _line_of(node: yaml.Node | None, loc: list[Any]) -> int | None:
    """The 1-based line of the deepest node on `loc` that the file has."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for key in loc:
        child = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(key):
                    child = v
                    line = k.start_mark.line + 1
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            child = node.value[key]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line
