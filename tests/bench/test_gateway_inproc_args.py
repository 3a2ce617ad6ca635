"""bench/gateway_inproc.py's --paths: "a,b" is paths a and b (it ran a path "," too, which timed whatever the
request loop fell through to), and anything but a, b and c, each once, is refused before a tree is extracted."""

from __future__ import annotations

import pytest

from bench.gateway_inproc import parse_args


@pytest.mark.parametrize(("given", "paths"), [("ab", "ab"), ("a,b", "ab"), ("c", "c"), ("b,c,a", "bca")])
def test_paths_are_letters_with_or_without_commas(given: str, paths: str) -> None:
    assert parse_args(["--paths", given]).paths == paths


@pytest.mark.parametrize("given", ["", ",", "a,x", "aa", "d"])
def test_other_paths_are_refused(given: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--paths", given])
    assert "--paths: each of a, b and c at most once" in capsys.readouterr().err
