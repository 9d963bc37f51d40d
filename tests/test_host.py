import gc

from dtgen.host import GcPauses, settle_heap


def test_gc_pauses_counts_collections_by_generation():
    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    assert pauses.count[0] >= 1 and pauses.count[2] >= 1
    assert pauses.max_ms <= pauses.total_ms
    assert pauses._callback not in gc.callbacks        # removed on exit
    report = pauses.as_dict()
    assert sum(report["collections_by_generation"]) == sum(pauses.count)


def test_settle_heap_moves_survivors_out_of_the_collectors_reach():
    keep = [object() for _ in range(1000)]
    try:
        settle_heap()
        assert gc.get_freeze_count() >= len(keep)
    finally:
        gc.unfreeze()      # leave the test process as it was
