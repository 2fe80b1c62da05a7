"""The schedule is a pure function of use positions: check its invariants on random use sequences."""

from hypothesis import given, strategies as st

from offload_compiler.passes.schedule import Use, build_schedule, peak_bytes

use_sequences = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2)), min_size=1, max_size=40)


def _uses(seq):
    return [Use(group, pos, pos + extra, key=pos) for pos, (group, extra) in enumerate(seq)]


@given(use_sequences, st.integers(0, 3), st.integers(1, 3))
def test_every_use_is_inside_exactly_one_fetch_of_its_group(seq, prefetch, max_runs):
    uses = _uses(seq)
    schedule = build_schedule(uses, prefetch, max_runs)
    owner = schedule.instance_of()
    for use in uses:
        inst = owner[use.key]
        assert inst.group == use.group and inst.start <= use.start and use.end <= inst.end
    assert sum(len(i.uses) for i in schedule.instances) == len(uses)


@given(use_sequences, st.integers(0, 3), st.integers(1, 3))
def test_fetch_order_and_prefetch_distance(seq, prefetch, max_runs):
    schedule = build_schedule(_uses(seq), prefetch, max_runs)
    starts = [i.start for i in schedule.instances]
    assert starts == sorted(starts)
    points = schedule.prefetch_at
    assert list(points) == sorted(points)  # prefetches are issued in fetch order
    for i, at in enumerate(points):
        assert max(i - prefetch, 0) <= at <= i  # never later than its own wait, never more than `prefetch` ahead


@given(use_sequences, st.integers(0, 3), st.integers(1, 3))
def test_no_group_has_two_copies_alive(seq, prefetch, max_runs):
    schedule = build_schedule(_uses(seq), prefetch, max_runs)
    by_group = {}
    for inst in schedule.instances:
        by_group.setdefault(inst.group, []).append(inst)
    for instances in by_group.values():
        assert len(instances) <= max_runs
        for a, b in zip(instances, instances[1:]):
            assert a.end < b.start  # refetched only after the previous copy's last reader
            # ... and not even prefetched before it: never two copies of one group on the device
            assert schedule.instances[schedule.prefetch_at[b.index]].start > a.end


def test_tied_weight_is_not_prefetched_while_its_first_copy_is_alive():
    uses = [Use(9, 0, 0, "emb"), Use(0, 1, 1, "b0"), Use(1, 2, 2, "norm"), Use(9, 3, 3, "head")]
    s = build_schedule(uses, 3)
    assert s.prefetch_at == (0, 0, 0, 1)  # the head's copy is prefetched after the embedding's copy is gone
    assert peak_bytes(s, {9: 100, 0: 10, 1: 1}) == 111


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=12), st.integers(0, 3))
def test_linear_chain_peak_is_the_largest_window_of_prefetch_plus_one_groups(sizes, prefetch):
    uses = [Use(g, 2 * g, 2 * g + 1, key=g) for g in range(len(sizes))]  # group g used once, in order
    schedule = build_schedule(uses, prefetch)
    window = prefetch + 1
    expected = max(sum(sizes[i:i + window]) for i in range(max(len(sizes) - window + 1, 1)))
    assert peak_bytes(schedule, dict(enumerate(sizes))) == expected


def test_weight_used_at_both_ends_is_fetched_twice_and_one_read_everywhere_once():
    # a tied embedding: used first and last
    uses = [Use(9, 0, 0, "emb"), Use(0, 1, 1, "b0"), Use(1, 2, 2, "b1"), Use(9, 3, 3, "head")]
    s = build_schedule(uses, 1)
    assert [i.group for i in s.instances] == [9, 0, 1, 9]
    # a table read inside every block: one fetch spanning its first to last read
    uses = [Use(g, p, p, (g, p)) for p, g in enumerate([0, 9, 1, 9, 2, 9, 3, 9])]
    s = build_schedule(uses, 1, max_runs=2)
    assert [i.group for i in s.instances].count(9) == 1
    assert next(i for i in s.instances if i.group == 9).end == 7


@given(use_sequences, st.integers(1, 3), st.integers(1, 3))
def test_carried_copies_are_the_first_prefetches_and_wait_for_their_group(seq, prefetch, max_runs):
    schedule = build_schedule(_uses(seq), prefetch, max_runs, carry=True)
    plain = build_schedule(_uses(seq), prefetch, max_runs)
    instances, n = schedule.instances, len(schedule.instances)
    assert schedule.instances == plain.instances and schedule.prefetch_at == plain.prefetch_at
    carried = [i for i, _ in schedule.carry_at]
    assert carried == [i.index for i in instances[:prefetch] if plain.prefetch_at[i.index] == 0][:len(carried)]
    assert carried and carried[0] == 0  # the first fetch of a call always comes from the previous call
    points = [at for _, at in schedule.carry_at]
    assert points == sorted(points) and points[0] >= schedule.prefetch_at[-1]
    for index, at in schedule.carry_at:
        group = instances[index].group
        last_end = max(i.end for i in instances if i.group == group)
        assert at == n or instances[at].start > last_end  # never two copies of one group on the device
        assert at >= n - prefetch + index  # no earlier than where the next call's instance would be prefetched


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=12), st.integers(1, 3))
def test_carried_linear_chain_peak_is_the_largest_cyclic_window(sizes, prefetch):
    """Calls repeated back to back are one cyclic sequence: with wrap-around, prefetch + 1 consecutive groups
    are alive at once, counted around the end of the call."""
    uses = [Use(g, 2 * g, 2 * g + 1, key=g) for g in range(len(sizes))]
    schedule = build_schedule(uses, prefetch, carry=True)
    window = min(prefetch + 1, len(sizes))
    cyclic = sizes + sizes
    expected = max(sum(cyclic[i:i + window]) for i in range(len(sizes)))
    assert peak_bytes(schedule, dict(enumerate(sizes))) == expected
    n = len(sizes)
    assert schedule.carry_at == tuple((i, max(n - prefetch + i, i + 1)) for i in range(min(prefetch, n)))


def test_tied_embedding_is_carried_after_the_head_is_gone():
    uses = [Use(9, 0, 0, "emb"), Use(0, 1, 1, "b0"), Use(1, 2, 2, "b1"), Use(9, 3, 3, "head")]
    s = build_schedule(uses, 1, carry=True)
    assert s.carry_at == ((0, 4),)  # after the last node: the head's copy of the same group is evicted first
    assert peak_bytes(s, {9: 100, 0: 10, 1: 1}) == 110


def test_a_group_on_disk_is_prefetched_once_the_read_prefetch_plus_one_before_it_is_waited_for():
    """Reads from disk run one at a time on the worker, in the order issued: with prefetch=1, each read is
    issued at the wait of the read two before it (the first two at the call's start), not one group before its
    own wait, so the next read is queued while the call computes the group in memory before the one just read."""
    uses = [Use(g, g, g, key=g) for g in range(8)]  # 1, 3, 5 and 7 on disk, a group in memory before each
    s = build_schedule(uses, 1, read_ahead=frozenset({1, 3, 5, 7}))
    assert s.prefetch_at == (0, 0, 1, 0, 3, 1, 5, 3)
    assert build_schedule(uses, 1).prefetch_at == (0, 0, 1, 2, 3, 4, 5, 6)
    assert build_schedule(uses, 2, read_ahead=frozenset({1, 3, 5, 7})).prefetch_at == (0, 0, 0, 0, 2, 0, 4, 1)
    assert peak_bytes(s, dict.fromkeys(range(8), 10)) == 40  # the slots read ahead are held from there: counted


def test_the_first_read_from_disk_is_issued_at_the_start_of_the_call():
    """Groups 3 and 5 on disk: both reads are issued as the call starts (the disk would otherwise idle while 0
    to 2 compute); the other prefetches keep their distance."""
    uses = [Use(g, g, g, key=g) for g in range(6)]
    s = build_schedule(uses, 1, read_ahead=frozenset({3, 5}))
    assert s.prefetch_at == (0, 0, 1, 0, 3, 0)
    assert build_schedule(uses, 0, read_ahead=frozenset({3, 5})).prefetch_at == (0, 1, 2, 3, 4, 5)  # no prefetch


@given(use_sequences, st.integers(0, 3), st.integers(1, 3), st.sets(st.integers(0, 5)))
def test_reads_ahead_never_put_two_copies_of_a_group_on_the_device_and_other_prefetches_keep_their_distance(
        seq, prefetch, max_runs, on_disk):
    schedule = build_schedule(_uses(seq), prefetch, max_runs, read_ahead=frozenset(on_disk))
    instances, points = schedule.instances, schedule.prefetch_at
    for inst in instances:
        at = points[inst.index]
        assert at <= inst.index  # never later than its own wait
        if inst.group not in on_disk:
            assert max(inst.index - prefetch, 0) <= at  # never more than `prefetch` ahead
    for a in instances:
        for b in instances[a.index + 1:]:
            if a.group == b.group:
                assert instances[points[b.index]].start > a.end  # never two copies of one group


def test_the_first_reads_from_disk_are_carried_where_the_reads_before_them_would_issue_them():
    """With wrap-around, the reads a call issues at its start (the first prefetch + 1 of groups on disk) are
    issued by the previous call at the wait of the read prefetch + 1 before them in the cyclic order (here
    reads 2 and 3 of the four), but after every other prefetch and in the order the disk reads them."""
    uses = [Use(g, g, g, key=g) for g in range(8)]  # 1, 3, 5 and 7 on disk, a group in memory before each
    s = build_schedule(uses, 1, carry=True, read_ahead=frozenset({1, 3, 5, 7}))
    assert s.prefetch_at == (0, 0, 1, 0, 3, 1, 5, 3)  # the call's own prefetches: as without carrying
    assert s.carry_at == ((1, 5), (0, 7), (3, 7))  # read 0 at the wait of read 2 (5), read 1 at read 3's (7)
    assert build_schedule(uses, 1, carry=True).carry_at == ((0, 7),)  # in memory: the first group only
    # prefetch=2: three reads carried, each at the wait of the read three before it (reads 1, 2 and 3 of this
    # call), the first no earlier than the call's last prefetch (at 4); the window is the one without carrying
    s = build_schedule(uses, 2, carry=True, read_ahead=frozenset({1, 3, 5, 7}))
    assert s.carry_at == ((1, 4), (3, 5), (0, 6), (5, 7))
    sizes = dict.fromkeys(range(8), 10)
    assert peak_bytes(s, sizes) == peak_bytes(build_schedule(uses, 2, read_ahead=frozenset({1, 3, 5, 7})), sizes)


@given(use_sequences, st.integers(1, 3), st.integers(1, 3), st.sets(st.integers(0, 5)))
def test_carried_reads_from_disk_are_the_reads_at_the_call_start_in_order_never_beside_their_own_copy(
        seq, prefetch, max_runs, on_disk):
    schedule = build_schedule(_uses(seq), prefetch, max_runs, carry=True, read_ahead=frozenset(on_disk))
    plain = build_schedule(_uses(seq), prefetch, max_runs, read_ahead=frozenset(on_disk))
    instances, n = schedule.instances, len(schedule.instances)
    assert schedule.instances == plain.instances and schedule.prefetch_at == plain.prefetch_at
    carried = [i for i, _ in schedule.carry_at]
    assert len(carried) == len(set(carried)) and all(plain.prefetch_at[i] == 0 for i in carried)
    reads = [i.index for i in instances if i.group in on_disk]
    first_reads = []
    for index in reads[:prefetch + 1]:
        if plain.prefetch_at[index] != 0:
            break
        first_reads.append(index)
    assert set(first_reads) <= set(carried)  # every read the call issues at its start, up to one that is not
    assert [i for i in carried if i in reads] == first_reads  # in the order the disk reads them
    points = [at for _, at in schedule.carry_at]
    assert points == sorted(points) and points[0] >= max(schedule.prefetch_at)
    for index, at in schedule.carry_at:
        last_end = max(i.end for i in instances if i.group == instances[index].group)
        assert at == n or instances[at].start > last_end  # never two copies of one group on the device
