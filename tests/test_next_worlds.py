"""The worlds a background compile prepares for (resilient_jax.elastic.next_worlds), pure."""

from resilient_jax.elastic.next_worlds import likely_next_worlds


def test_one_host_fewer_per_region_first_then_one_region_fewer():
    assert likely_next_worlds(["us", "us", "eu", "eu"]) == [
        ("us", "eu", "eu"), ("us", "us", "eu"),  # a host lost from us / from eu
        ("eu", "eu"), ("us", "us"),  # region us lost / region eu lost
    ]


def test_interleaved_regions_give_one_candidate_per_position_that_differs():
    assert likely_next_worlds(["a", "b", "a"]) == [("b", "a"), ("a", "a"), ("a", "b"), ("b",)]


def test_worlds_below_min_hosts_are_never_formed_so_never_compiled():
    assert likely_next_worlds(["us", "us", "eu", "eu"], min_hosts=3) == [("us", "eu", "eu"), ("us", "us", "eu")]
    assert likely_next_worlds(["us"]) == []  # a lone host has no smaller world
