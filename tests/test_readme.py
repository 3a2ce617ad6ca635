"""README.md is what an operator reads at 3 a.m.: every `TIERGATE_*` variable it names is one the code reads (a
field of gateway/settings.py's Settings, or a name some package reads from the environment), every variable an
operator can set is named there, and every `tiergate` command and flag it shows exists. A renamed setting, command
or flag fails here instead of in an outage."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click

from gateway.cli.main import cli
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PACKAGES = ("gateway", "quotas", "cache", "tiers", "engine", "wire", "assets", "training", "bench")
NAME = re.compile(r"\bTIERGATE_[A-Z0-9_]+")
# set by the gateway for the processes it starts, never by an operator
INTERNAL = {"TIERGATE_ENGINES_FILE", "TIERGATE_WORKER_SETTINGS", "TIERGATE_WORKER_INDEX", "TIERGATE_ENGINE_INSTANCE"}


def settings_names() -> set[str]:
    return {"TIERGATE_" + name.upper() for name in Settings.model_fields}


def environment_names() -> set[str]:
    """Every string constant of the packages that is a whole `TIERGATE_*` name: what code reads from (or sets in)
    the environment outside Settings (os.environ.get("TIERGATE_CORE_BUDGET"), ENGINE_API_KEY_ENV = "...")."""
    names = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                    names.add(node.value)
    return names


def test_every_variable_the_readme_names_is_read() -> None:
    known = settings_names() | environment_names()
    named = set(NAME.findall(README))
    prefixes = {n for n in named if n.endswith("_")}  # `TIERGATE_EMBEDDER_*`: a family, some member of it read
    unknown = {n for n in named - prefixes if n not in known}
    unknown |= {p for p in prefixes if not any(k.startswith(p) for k in known)}
    assert not unknown, f"README.md names variables the code does not read: {sorted(unknown)}"


def test_every_variable_an_operator_can_set_is_in_the_readme() -> None:
    named = set(NAME.findall(README))
    missing = (settings_names() | environment_names()) - INTERNAL - named
    assert not missing, f"document these in README.md (one line each, where they act): {sorted(missing)}"


def readme_commands() -> list[str]:
    """The `tiergate …` lines of the "Command line" summary (indented lines continue the one above) and every
    inline `tiergate …` code span, each on one line."""
    block = README.split("## Command line", 1)[1].split("```", 2)[1]
    lines: list[str] = []
    for line in block.splitlines():
        if line.startswith("tiergate "):
            lines.append(line)
        elif line.strip() and lines:
            lines[-1] += " " + line.strip()
    spans = [" ".join(span.split()) for span in re.findall(r"`(tiergate\s[^`]+)`", README)]
    assert len(lines) >= 10 and len(spans) >= 10  # the parse found what it reads
    return lines + spans


def _resolve(group: click.Group, words: list[str]) -> tuple[click.Command, click.Group]:
    """The command `words` name from `group` (descending while a word is a subcommand), and the group it is in."""
    cmd: click.Command = group
    for word in words:
        if not isinstance(cmd, click.Group) or word not in cmd.commands:
            break
        group, cmd = cmd, cmd.commands[word]
    return cmd, group


def check_command_line(line: str) -> list[str]:
    """What is wrong with one README command line: a command that does not resolve to one that runs, or a flag the
    command does not take. Alternatives after `|` are another subcommand of the same group (`status | history`), a
    command from the top (`keys revoke KEY_ID`), further flags (`--tenant NAME | --admin`), or a value
    (`--format table|csv|json`)."""
    problems = []
    current: click.Command | None = None
    group: click.Group = cli
    for i, segment in enumerate(line.removeprefix("tiergate ").split("|")):
        words = [w for w in re.split(r"[\s\[\]]+", segment) if w and not w.startswith("-")]
        first = words[0] if words else ""
        if i == 0 or first in cli.commands or first in group.commands:
            start = cli if i == 0 or first in cli.commands else group
            cmd, group = _resolve(start, words)
            if cmd is start or (isinstance(cmd, click.Group) and not cmd.invoke_without_command):
                problems.append(f"{line!r}: {segment.strip()!r} names no command")
                current = None
                continue
            current = cmd
        if current is None:
            continue
        flags = {opt for param in current.params for opt in param.opts}
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", segment):
            if flag not in flags:
                problems.append(f"{line!r}: `{current.name}` has no {flag}")
    return problems


def test_every_command_and_flag_the_readme_shows_exists() -> None:
    problems = [p for line in readme_commands() for p in check_command_line(line)]
    assert not problems, "\n".join(problems)


def _options(group: click.Group, path: str = "tiergate") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out += _options(cmd, f"{path} {name}")
        out += [(f"{path} {name}", opt) for p in cmd.params if isinstance(p, click.Option) and not p.hidden
                for opt in p.opts if opt.startswith("--") and opt not in ("--help", "--data-dir")]
    return out


def test_every_flag_a_command_takes_is_in_the_command_line_summary() -> None:
    """The reverse of the check above: `engine serve --kv-cache-bytes`, `router train --reference` and a dozen more
    were in --help only (--data-dir is every command's, and said once)."""
    block = README.split("## Command line", 1)[1].split("## Security", 1)[0]
    missing = [f"{path} {opt}" for path, opt in _options(cli) if not re.search(rf"(?<![\w-]){opt}(?![\w-])", block)]
    assert not missing, "add to README.md's Command line: " + ", ".join(missing)


def test_the_command_check_catches_a_wrong_name() -> None:
    assert check_command_line("tiergate degrade status | set LEVEL --reason R | auto | history") == []
    assert check_command_line("tiergate keys issue --tenant NAME | --admin [--ttl 30d|SECONDS]") == []
    assert check_command_line("tiergate usage report --format table|csv|json") == []
    assert check_command_line("tiergate degrade stauts")  # a misspelled subcommand
    assert check_command_line("tiergate keys rotate KEY_ID --grce 1h")  # a flag it does not take
    assert check_command_line("tiergate rollout start TIER V --reason R | pause TIER --resaon R")
    assert check_command_line("tiergate tenants set-plan NAME PLAN | tenants bump NAME")
