"""The evaluation loader of every stage (dschat/stage.py): a rank's shard, and lockstep batches across ranks."""

import pytest
import torch

from dschat.training import stage as S


def _collate(rows):
    return list(rows)


def test_eval_loader_is_its_shard_with_a_filler_batch():
    ev = S.eval_loader(list(range(5)), 2, _collate)
    assert len(ev) == 3 and list(ev) == [[0, 1], [2, 3], [4]]
    assert ev.filler == [0]  # one real row, collated
    assert list(S.lockstep_batches(ev)) == [([0, 1], True), ([2, 3], True), ([4], True)]
    empty = S.eval_loader([], 2, _collate)
    assert len(empty) == 0 and empty.filler is None and list(S.lockstep_batches(empty)) == []


def test_a_short_shard_runs_filler_batches_in_step_with_the_longest(monkeypatch):
    """Rank 1 of 2 holds rows 1 and 3 (one batch of 2); rank 0 holds three rows (two batches): rank 1 must run
    one throw-away batch so both ranks run two forwards."""
    monkeypatch.setattr(S.E, "rank", lambda: 1)
    monkeypatch.setattr(S.E, "world_size", lambda: 2)
    ev = S.eval_loader(list(range(5)), 2, _collate)
    assert list(ev) == [[1, 3]]
    monkeypatch.setattr(S.E, "all_reduce_max", lambda t: torch.tensor(2))  # the longest shard: 2 batches
    assert list(S.lockstep_batches(ev)) == [([1, 3], True), ([0], False)]
    with pytest.raises(RuntimeError, match="no batch"):  # an empty shard has no row to run
        list(S.lockstep_batches(S.eval_loader([], 2, _collate)))
