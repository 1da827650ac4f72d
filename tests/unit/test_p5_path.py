"""P5's split of the trainer's timeline (benchmarks/p5_path.py), on timelines worked out by hand."""

from __future__ import annotations

import pytest

from benchmarks.p5_path import describe, overhead_split, stored_at, trainer_path


def test_a_row_is_stored_when_its_last_producing_put_returned():
    puts = [(2.0, 0, [1, 2]), (3.0, 0, [2]), (1.0, 1, [2]), (2.5, 0, [1])]
    assert stored_at(puts) == {(0, 1): 2.5, (0, 2): 3.0, (1, 2): 1.0}


def test_the_pieces_add_up_to_the_wall_time_and_each_lands_where_it_happened():
    puts = [(1.0, 0, [0, 1]), (1.5, 0, [1]), (2.0, 1, [0])]
    batches = [
        # asked at 0.5, rows stored at 1.5, claim back at 1.7, compute 1.8-2.8
        (0, 0.5, 1.7, 1.8, 1.0, [0, 1]),
        # asked at 3.0 with its row stored at 2.0 already: all of 3.0-3.2 is the claim
        (1, 3.0, 3.2, 3.25, 0.5, [0]),
    ]
    path = trainer_path(batches, puts, start=0.0, end=4.0)
    assert path["compute_s"] == pytest.approx(1.5)
    assert path["waiting_s"] == pytest.approx(1.0)  # 0.5 -> 1.5
    assert path["claims_s"] == pytest.approx(0.2 + 0.2)
    assert path["glue_s"] == pytest.approx(0.1 + 0.05)
    assert path["between_s"] == pytest.approx(0.5 + 0.2 + 0.25)  # before the first ask, 2.8 -> 3.0, 3.75 -> 4.0
    total = sum(path[k] for k in ("compute_s", "waiting_s", "claims_s", "glue_s", "between_s"))
    assert total == pytest.approx(4.0)
    assert path["claims"] == 2
    assert path["claim_median_ms"] == pytest.approx(200.0)


def test_a_claim_that_returns_before_the_put_does_is_all_waiting():
    # the rows became visible before the producer's put returned at 2.0: the claim came back at 1.8
    path = trainer_path([(0, 1.0, 1.8, 1.8, 0.2, [0])], [(2.0, 0, [0])], start=1.0, end=2.0)
    assert path["waiting_s"] == pytest.approx(0.8)
    assert path["claims_s"] == 0.0


def test_rows_no_put_logged_count_as_stored_when_asked():
    path = trainer_path([(0, 1.0, 1.5, 1.5, 0.5, [7])], [], start=1.0, end=2.0)
    assert (path["waiting_s"], path["claims_s"]) == (0.0, pytest.approx(0.5))


def test_the_overhead_split_adds_up_to_the_wall_time_above_the_bound():
    puts = [(1.0, 0, [0])]
    path = trainer_path([(0, 0.2, 1.3, 1.4, 1.0, [0])], puts, start=0.0, end=2.5)
    bound = 1.8  # the schedule has the trainer wait 0.8 s for its rows; it waited 0.8 s (0.2 -> 1.0)
    split = overhead_split(path, bound)
    assert split["upstream_s"] == pytest.approx(0.0)
    assert sum(split.values()) == pytest.approx(2.5 - bound)
    line = describe(split, path)
    assert "its claims 300 ms (1 claim, median 300.0 ms)" in line
    assert "waiting for rows beyond the schedule 0 ms" in line
