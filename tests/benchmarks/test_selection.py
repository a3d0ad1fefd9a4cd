"""Benchmark selections: rows named explicitly run; a selection of nothing is an error."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import reproduce_odyssey, reproduce_oobleck
from benchmarks.reproduce_odyssey import SETTINGS, select


def parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="test")


@given(st.sets(st.integers(0, len(SETTINGS) - 1), min_size=1))
def test_rows_run_whatever_their_group(rows: set[int]) -> None:
    text = ",".join(str(r) for r in sorted(rows, reverse=True))
    assert select(parser(), None, text) == sorted(rows)


@given(st.sets(st.sampled_from(["paper", "sensitivity", "beyond"]), min_size=1))
def test_groups_run_all_their_rows(groups: set[str]) -> None:
    chosen = select(parser(), ",".join(groups), None)
    assert chosen == [i for i, s in enumerate(SETTINGS) if s.group in groups]


def test_the_default_is_the_paper_group() -> None:
    assert [SETTINGS[i].group for i in select(parser(), None, None)] == ["paper"]


def test_rows_and_groups_together_run_their_intersection() -> None:
    beyond = [i for i, s in enumerate(SETTINGS) if s.group == "beyond"]
    assert select(parser(), "beyond", f"0,{beyond[0]}") == [beyond[0]]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rows", "0", "--only", "beyond"], "matches no row"),
        (["--rows", str(len(SETTINGS))], f"unknown row(s) {len(SETTINGS)}"),
        (["--rows", "two"], "comma-separated row numbers"),
        (["--rows", ","], "matches no row"),
        (["--only", "papers"], "unknown group(s) papers"),
        (["--seeds", "0"], "--seeds must be at least 1"),
    ],
)
def test_odyssey_selection_errors_name_the_known_rows(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        reproduce_odyssey.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if "row" in message or "group" in message:
        assert f"known groups: paper, sensitivity, beyond; rows 0-{len(SETTINGS) - 1}" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--models", ""], "matches no cell"),
        (["--models", "gpt4"], "unknown model 'gpt4'"),
        (["--intervals", "5min"], "unknown interval '5min'"),
        (["--systems", "oobleck,checkfree"], "unknown system 'checkfree'"),
    ],
)
def test_oobleck_selection_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        reproduce_oobleck.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
