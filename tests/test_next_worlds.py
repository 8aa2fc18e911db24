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


def test_with_replica_groups_the_unit_is_a_group_and_min_replicas_bounds_it():
    # Groups of 2: (us, us) (eu, eu) (ap, ap). A death idles a whole group, a region loss its groups.
    world = ["us", "us", "eu", "eu", "ap", "ap"]
    assert likely_next_worlds(world, hosts_per_replica=2) == [
        ("eu", "eu", "ap", "ap"), ("us", "us", "ap", "ap"), ("us", "us", "eu", "eu")]
    assert likely_next_worlds(world, hosts_per_replica=2, min_replicas=3) == []
    # A group across regions (allow_cross_region_replica) goes with either region.
    assert likely_next_worlds(["us", "eu", "eu", "eu"], hosts_per_replica=2) == [("eu", "eu"), ("us", "eu")]
