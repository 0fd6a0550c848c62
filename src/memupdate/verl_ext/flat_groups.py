"""Which rows of a GRPO batch an update needs (:class:`memupdate.verl_ext.trainer.FlatGroupSkippingTrainer`): a
pure function, apart from verl, so that it is tested without starting verl's trainer."""

from __future__ import annotations

from collections.abc import Sequence


def rows_to_train(groups: Sequence[str], learns: Sequence[bool], multiple: int) -> list[int]:
    """The rows an update needs: those of every group (rows sharing an id in ``groups``) in which some row
    ``learns`` (has a non-zero advantage), topped up with whole flat groups, in batch order, until their number is a
    multiple of ``multiple``; every row when no such top-up exists, none when no group learns.

    >>> rows_to_train(["a", "a", "b", "b", "c", "c"], [False, False, True, False, False, False], 2)
    [2, 3]
    >>> rows_to_train(["a", "a", "b", "b", "c", "c"], [False, False, True, False, False, False], 4)
    [0, 1, 2, 3]
    >>> rows_to_train(["a", "b"], [False, False], 2), rows_to_train(["a", "b", "b"], [True, False, False], 2)
    ([], [0, 1, 2])
    """
    if len(groups) != len(learns):
        raise ValueError(f"{len(groups)} group ids for {len(learns)} rows")
    rows: dict[str, list[int]] = {}
    for row, group in enumerate(groups):
        rows.setdefault(group, []).append(row)
    learning = {group for group, row_learns in zip(groups, learns, strict=True) if row_learns}
    if not learning:
        return []
    kept = [row for group in learning for row in rows[group]]
    for group, group_rows in rows.items():
        if len(kept) % multiple == 0:
            return sorted(kept)
        if group not in learning:
            kept += group_rows
    return sorted(kept) if len(kept) % multiple == 0 else list(range(len(groups)))
