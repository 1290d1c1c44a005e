"""The suite's file order under xdist (`support.suite_order.LONGEST_FIRST`) names files that exist, and xdist
keeps that order instead of sorting the files by how many tests each holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.suite_order import LONGEST_FIRST


def test_longest_first_names_existing_files_once() -> None:
    here = Path(__file__).parent
    missing = [name for name in LONGEST_FIRST if not (here / name).is_file()]
    assert not missing, missing
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_xdist_keeps_the_collection_order(request: pytest.FixtureRequest) -> None:
    assert request.config.getoption("loadscopereorder") is False
