"""The thread Loader's shuffles (`deal_rows`, then each bucket by `shuffle_rows`):
every row once, reproducible from the bit generator, uniform over the orders, and
pinned, so that a state saved by one version is continued in the same order by the
next."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastst._core import SHUFFLE_BUCKET_ROWS, deal_rows, shuffle_rows
from fastst._data.order import permutation


def shuffled_rows(total: int, generator: np.random.BitGenerator, bucket_rows: int
                  ) -> np.ndarray:
    """The rows dealt to buckets of `bucket_rows`, each bucket then shuffled in turn."""
    rows, ends = deal_rows(total, generator, bucket_rows)
    for start, end in zip([0] + ends[:-1].tolist(), ends.tolist()):
        shuffle_rows(rows[start:end], generator)
    return rows


def chi_square(counts: np.ndarray) -> float:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


def far_beyond_chance(statistic: float, freedom: int) -> bool:
    """Six standard deviations past the chi-square's mean: a uniform draw passes it
    but once in hundreds of millions, where a biased one lands far beyond."""
    return statistic > freedom + 6 * math.sqrt(2 * freedom)


@settings(max_examples=150, deadline=None)
@given(total=st.integers(0, 3000), bucket_rows=st.integers(1, 400), seed=st.integers(0, 9))
def test_every_row_is_in_the_permutation_once(total, bucket_rows, seed):
    rows = shuffled_rows(total, np.random.PCG64(seed), bucket_rows)
    assert rows.dtype == np.int64 and rows.flags.c_contiguous
    assert np.array_equal(np.sort(rows), np.arange(total))


@pytest.mark.parametrize("total,bucket_rows,buckets", [(0, 4, 1), (1, 4, 1), (8, 4, 2),
                                                       (9, 4, 3), (11, 4, 3), (3, 4, 1)])
def test_the_deal_makes_ceil_total_over_bucket_rows_buckets(total, bucket_rows, buckets):
    """Each bucket's rows in order, the buckets one after another."""
    rows, ends = deal_rows(total, np.random.PCG64(5), bucket_rows)
    assert len(ends) == buckets and (ends[-1] if total else 0) == total
    assert np.array_equal(np.sort(rows), np.arange(total))
    for start, end in zip([0] + ends[:-1].tolist(), ends.tolist()):
        assert np.all(np.diff(rows[start:end]) > 0)


def test_the_same_seed_draws_the_same_order_and_the_generator_moves_on():
    generator = np.random.PCG64(4)
    first, second = shuffled_rows(5000, generator, 64), shuffled_rows(5000, generator, 64)
    assert not np.array_equal(first, second)
    again = np.random.PCG64(4)
    assert np.array_equal(shuffled_rows(5000, again, 64), first)
    assert np.array_equal(shuffled_rows(5000, again, 64), second)


@pytest.mark.parametrize("bucket_rows", [1, 2, 3, 4])
def test_every_order_of_four_rows_is_as_likely(bucket_rows):
    """24,000 permutations of 4 rows, dealt to 4, 2, 2 and 1 buckets: each of the 24
    orders about 1,000 times."""
    generator = np.random.PCG64(11)
    places = {order: k for k, order in enumerate(itertools.permutations(range(4)))}
    counts = np.zeros(24)
    for _ in range(24_000):
        counts[places[tuple(shuffled_rows(4, generator, bucket_rows).tolist())]] += 1
    assert not far_beyond_chance(chi_square(counts), 23), counts


def test_every_row_lands_in_every_place_as_often_over_many_buckets():
    """A row's place is uniform across buckets too: rows dealt in turn (rows 0-2 to
    the first bucket, ...) rather than at random would keep row 0 in the first
    places."""
    generator = np.random.PCG64(12)
    counts = np.zeros((10, 10))
    for _ in range(20_000):
        counts[shuffled_rows(10, generator, 3), np.arange(10)] += 1
    assert not far_beyond_chance(chi_square(counts), 81), counts


def test_shuffle_rows_shuffles_in_place_uniformly():
    generator = np.random.PCG64(13)
    places = {order: k for k, order in enumerate(itertools.permutations(range(4)))}
    counts = np.zeros(24)
    for _ in range(24_000):
        rows = np.arange(4, dtype=np.int64)
        shuffle_rows(rows, generator)
        counts[places[tuple(rows.tolist())]] += 1
    assert not far_beyond_chance(chi_square(counts), 23), counts


def test_the_orders_are_pinned():
    """The orders a state's position is in: drawn otherwise, a job continued from its
    state would take some rows twice and others never (a change of the draws goes
    with a new "draws" setting of the Loader's state). `permutation` is the Loader's
    order laid out whole (EpochRows); the same as dealt and shuffled in turn."""
    assert permutation(12, 0, 0).tolist() == [3, 1, 11, 4, 9, 6, 0, 8, 2, 5, 7, 10]
    many = permutation(40000, 3, 1)
    assert np.array_equal(many, shuffled_rows(40000, np.random.PCG64([3, 1]),
                                              SHUFFLE_BUCKET_ROWS))
    assert many[:8].tolist() == [18638, 11968, 37845, 7071, 16766, 1983, 16790, 39469]
    assert many[-4:].tolist() == [29620, 31153, 30655, 1006]
    rows = np.arange(10, dtype=np.int64)
    shuffle_rows(rows, np.random.PCG64(7))
    assert rows.tolist() == [1, 2, 0, 4, 7, 3, 6, 8, 5, 9]


@pytest.mark.parametrize("rows", [np.arange(10, dtype=np.int32), np.arange(20)[::2],
                                  np.arange(12).reshape(3, 4), list(range(10))],
                         ids=["int32", "strided", "two axes", "a list"])
def test_shuffle_rows_takes_only_a_writable_contiguous_int64_axis(rows):
    with pytest.raises((ValueError, TypeError)):
        shuffle_rows(rows, np.random.PCG64(0))


def test_shuffle_rows_refuses_a_read_only_array():
    rows = np.arange(10)
    rows.setflags(write=False)
    with pytest.raises(ValueError, match="writable"):
        shuffle_rows(rows, np.random.PCG64(0))
    assert rows.tolist() == list(range(10))


@pytest.mark.parametrize("total,bucket_rows", [(-1, 10), (10, 0)])
def test_the_deal_refuses_a_negative_count_or_empty_buckets(total, bucket_rows):
    with pytest.raises(ValueError, match="no permutation"):
        deal_rows(total, np.random.PCG64(0), bucket_rows)
