"""`imports_without_gc`: the collector is off inside the block, back on after it, and what the
block made is frozen; an enclosing block, the caller's own choice and the opt-out are kept."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tether.runtime.process.gc_tuning import ENV, imports_without_gc


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    was = gc.isenabled()
    yield
    gc.unfreeze()  # the frozen objects go back to the oldest generation
    if was:
        gc.enable()
    else:
        gc.disable()


def test_the_block_runs_without_the_collector_and_freezes_what_it_made() -> None:
    gc.enable()
    gc.unfreeze()
    with imports_without_gc():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]  # containers the collector would otherwise track
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)


def test_an_error_in_the_block_still_turns_the_collector_back_on() -> None:
    gc.enable()
    with pytest.raises(ImportError), imports_without_gc():
        raise ImportError("no such module")
    assert gc.isenabled()


def test_a_collector_already_off_stays_off_and_nothing_is_frozen() -> None:
    gc.unfreeze()
    gc.disable()
    with imports_without_gc():
        assert not gc.isenabled()
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_nested_blocks_turn_it_on_once_at_the_outer_end() -> None:
    gc.enable()
    with imports_without_gc():
        with imports_without_gc():
            pass
        assert not gc.isenabled()  # the inner block leaves the outer one's choice alone
    assert gc.isenabled()


def test_the_switch_leaves_the_collector_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1")
    gc.enable()
    gc.unfreeze()
    with imports_without_gc():
        assert gc.isenabled()
    assert gc.get_freeze_count() == 0
