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


def test_trim_heap_hands_freed_pages_back():
    """On glibc (Linux: this suite's machines) trim_heap runs malloc_trim and says True;
    where there is no malloc_trim it is a no-op that says False. What it frees is measured
    by bench/bench_serve.py's idle RSS, not here (the heap's state is the process's)."""
    import sys

    from dtgen.host import trim_heap
    trimmed = trim_heap()
    assert trimmed is (sys.platform.startswith("linux"))
    assert trim_heap() is trimmed   # the library is looked up once; a second call is the same
