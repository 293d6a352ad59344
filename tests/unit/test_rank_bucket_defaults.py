"""Which rank buckets an engine compiles when ``rank_buckets`` is unset, and how to ask for none."""

from hotlora.settings import EngineConfig, ServerConfig


def test_unset_means_no_adapters_and_a_quarter_of_the_target_rank_in_slots_mode():
    assert EngineConfig().rank_buckets is None
    assert EngineConfig().bucket_ranks == (0, 4)  # target_rank 16
    assert EngineConfig(target_rank=128).bucket_ranks == (0, 32)
    assert EngineConfig(target_rank=2).bucket_ranks == (0,)
    # Only the slots of single-request packs have buckets.
    assert EngineConfig(mixed=True).bucket_ranks == () and EngineConfig(adapter_mode="fused").bucket_ranks == ()


def test_given_buckets_are_kept_and_an_empty_list_turns_them_off():
    assert EngineConfig(rank_buckets="0,8").bucket_ranks == (0, 8)
    assert EngineConfig(rank_buckets="").bucket_ranks == ()
    assert ServerConfig.load(rank_buckets="")[0].engine_config().bucket_ranks == ()


def test_the_compile_fingerprint_holds_the_buckets_compiled():
    unset, given = EngineConfig(target_rank=16), EngineConfig(target_rank=16, rank_buckets=(0, 4))
    assert unset.fingerprint("m", "flux") == given.fingerprint("m", "flux")
    assert unset.fingerprint("m", "flux") != EngineConfig(target_rank=16, rank_buckets=()).fingerprint("m", "flux")
