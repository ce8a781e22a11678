import pytest

from dp_core import padded_batch_size, per_replica_batch_size


def test_divides():
    assert per_replica_batch_size(64, 4) == 16
    assert per_replica_batch_size(33, 1) == 33


def test_indivisible_names_both_numbers_and_the_nearest_valid_sizes():
    with pytest.raises(ValueError, match="does not divide evenly") as info:
        per_replica_batch_size(33, 2)
    message = str(info.value)
    assert "global_batch_size=33" in message and "num_replicas=2" in message
    assert "32 or 34" in message


def test_smaller_than_replica_count_suggests_the_replica_count():
    with pytest.raises(ValueError, match=r"global_batch_size=4\b"):
        per_replica_batch_size(3, 4)


@pytest.mark.parametrize("bad", [0, -8, 2.0, True, "8"])
def test_rejects_non_positive_or_non_int(bad):
    with pytest.raises(ValueError, match=f"global_batch_size must be a positive integer, got {bad!r}"):
        per_replica_batch_size(bad, 2)


def test_padded_batch_size_rounds_up_to_a_multiple_of_the_replicas():
    assert [padded_batch_size(size, 4) for size in (1, 4, 5, 8, 33)] == [4, 4, 8, 8, 36]
    assert padded_batch_size(33, 2) == 34 and padded_batch_size(33, 1) == 33
    with pytest.raises(ValueError, match="num_replicas must be a positive integer, got 0"):
        padded_batch_size(8, 0)
