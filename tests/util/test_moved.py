"""Modules that moved keep their old import path for one release (swarm/utils/moved.py): the old
name is the new module itself, with a DeprecationWarning that names the new path."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from swarm.utils import eventloop, moved


def test_an_old_name_is_the_new_module_and_says_where_it_went(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "swarm.eventloop", raising=False)
    with pytest.warns(DeprecationWarning, match="swarm.eventloop moved to swarm.utils.eventloop"):
        old = importlib.import_module("swarm.eventloop")
    assert old is eventloop and old.run is eventloop.run


def test_every_new_name_exists_and_no_old_name_is_still_a_file() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for old, new in moved.MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        assert not (root / (old.replace(".", "/") + ".py")).exists(), f"{old} is both moved and present"
