"""Which rows the CPU experiments' trainer mode updates on (memupdate.verl_ext.flat_groups); that verl's trainer runs
the update on them is checked where it runs, in tests/training/test_verl_cpu.py."""

import pytest

from memupdate.verl_ext.flat_groups import rows_to_train


def test_a_group_is_kept_whole_when_any_of_its_rows_has_an_advantage():
    # A group with spread can hold a row at its mean (advantage 0): that row still counts in the token mean.
    groups = ["p", "p", "p", "p", "q", "q", "q", "q"]
    learns = [False, False, True, False, False, False, False, False]
    assert rows_to_train(groups, learns, 4) == [0, 1, 2, 3]


def test_flat_groups_top_up_the_rows_to_what_the_ranks_need_in_batch_order():
    # Two rollouts per prompt on four data-parallel ranks: rows by fours; the first flat group in the batch tops up.
    groups = ["flat1", "flat1", "learn", "learn", "flat2", "flat2", "learn2", "learn2", "learn3", "learn3"]
    learns = [False, False, True, False, False, False, False, True, True, True]
    assert rows_to_train(groups, learns, 4) == [0, 1, 2, 3, 6, 7, 8, 9]


def test_no_group_that_learns_trains_nothing_and_no_top_up_trains_everything():
    assert rows_to_train(["a", "a", "b", "b"], [False] * 4, 2) == []
    assert rows_to_train(["a", "b", "b"], [True, False, False], 2) == [0, 1, 2]


def test_rows_and_groups_must_match():
    with pytest.raises(ValueError, match="3 group ids for 2 rows"):
        rows_to_train(["a", "a", "b"], [True, False], 2)
