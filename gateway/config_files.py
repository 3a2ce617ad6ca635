"""YAML files parsed once into typed, validated objects; a bad file names its path, line and reason.

What an on-call edit can get wrong is refused here, for every file alike (tiers, plans, the ladder), before any
model sees it: a file over MAX_CONFIG_BYTES (a path mistaken for a config file, /dev/zero among them, was read
whole and hung the reload), bytes that are not UTF-8, nesting deeper than MAX_DEPTH (PyYAML recursed, and its
RecursionError was a 500 for the reload and a traceback for start-up), and a key given twice in one mapping
(YAML keeps the last silently: a second `context_limit:` or a second tier of one name replaced the first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
MAX_CONFIG_BYTES = 1 << 20  # 1 MiB: the shipped files are a few KB; a plans file of thousands of plans fits
MAX_DEPTH = 64  # nested mappings and lists: the schemas need fewer than 10
_SHAPE_ERRORS = ("missing", "extra_forbidden")
_MERGE = "<<"  # YAML's merge key (`<<: *defaults`) may follow keys it does not replace


class ConfigFileError(Exception):
    """A configuration file is missing, is not valid YAML, or does not fit its schema."""

    def __init__(self, path: Path, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line else str(path)
        super().__init__(f"{where}: {reason}")


def load_yaml(path: Path, model: type[M], context: dict[str, Any] | None = None) -> M:
    """Parse `path` into `model`; `context` reaches the model's validators (e.g. known tier names)."""
    text = _read(path)
    try:
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
            _check_tree(path, root)
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise ConfigFileError(path, line, f"not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    except RecursionError as exc:  # the parser's own recursion, before _check_tree sees the tree
        raise ConfigFileError(path, None, f"nested more than {MAX_DEPTH} levels deep") from exc
    try:
        return model.model_validate(data if data is not None else {}, context=context)
    except ValidationError as exc:
        errors = exc.errors()
        # of a union's members (the ladder's actions), the one whose own field is wrong says more than the others'
        # missing and unknown fields ("cap_output_tokens: true" is no "remap_tiers: Field required")
        err = next((e for e in errors if e["type"] not in _SHAPE_ERRORS), errors[0])
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        where = ".".join(str(p) for p in loc)
        reason = f"{where}: {err['msg']}" if where else err["msg"]
        raise ConfigFileError(path, _line_of(root, loc), reason) from exc


def _read(path: Path) -> str:
    """The file's text: at most MAX_CONFIG_BYTES of UTF-8 (read no further, whatever the path is)."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigFileError(path, None, f"cannot read: {exc.strerror or exc}") from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigFileError(path, None, f"larger than {MAX_CONFIG_BYTES} bytes; is this the right file?")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigFileError(path, line, f"not UTF-8 text (byte {exc.start})") from exc


def _check_tree(path: Path, root: yaml.Node | None) -> None:
    """Refuse nesting deeper than MAX_DEPTH and a key repeated in one mapping, naming the line (iterative, and each
    node once: an alias shares its node)."""
    seen: set[int] = set()
    stack = [(root, 1)] if root is not None else []
    while stack:
        node, depth = stack.pop()
        if id(node) in seen or not isinstance(node, yaml.MappingNode | yaml.SequenceNode):
            continue
        seen.add(id(node))
        if depth > MAX_DEPTH:
            raise ConfigFileError(path, node.start_mark.line + 1, f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, depth + 1) for child in node.value)
            continue
        keys: dict[str, int] = {}
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.value != _MERGE:
                line = k.start_mark.line + 1
                if k.value in keys:
                    raise ConfigFileError(path, line, f"{k.value!r} is given twice in one mapping (lines "
                                                      f"{keys[k.value]} and {line}); YAML would keep only the last")
                keys[k.value] = line
            stack.extend(((k, depth + 1), (v, depth + 1)))


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
