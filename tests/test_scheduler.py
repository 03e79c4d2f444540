"""Scheduler: token budget, chunked prefill, FCFS admission, preemption of the newest request."""
from tokenmill.core.block_manager import BlockManager
from tokenmill.core.request import Request
from tokenmill.core.sched_output import RunnerOutput
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32, max_len=1000, caching=False, policy="fcfs"):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len, policy), bm), bm


def add(s, i, n, max_tokens=100, priority=0, tokens=None):
    r = Request(f"r{i}", tokens or list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), {0},
                priority=priority)
    s.add_request(r)
    return r


def run_step(s, token=7):
    out = s.schedule()
    s.update(out, RunnerOutput(sampled={e.req_id: [token] for e in out.scheduled if e.sample}))
    return out


def test_chunked_prefill_within_budget_then_decode():
    s, bm = make(budget=10)
    r = add(s, 0, 25)
    sizes = [len(run_step(s).scheduled[0].token_ids) for _ in range(4)]
    assert sizes == [10, 10, 5, 1]
    assert r.num_output_tokens == 2           # sampled after the last chunk, then one decode
    assert r.num_computed_tokens == 26


def test_running_first_then_waiting_fcfs_and_budget_shared():
    s, bm = make(budget=12)
    a = add(s, 0, 8)
    run_step(s)                                # a prefilled
    b, c = add(s, 1, 8), add(s, 2, 8)
    out = run_step(s)
    assert [(e.req_id, len(e.token_ids), e.sample) for e in out.scheduled] == [("r0", 1, True), ("r1", 8, True),
                                                                              ("r2", 3, False)]
    out = run_step(s)
    assert [(e.req_id, len(e.token_ids)) for e in out.scheduled] == [("r0", 1), ("r1", 1), ("r2", 5)]


def test_max_num_seqs_limits_admission():
    s, _ = make(max_seqs=2)
    for i in range(3):
        add(s, i, 2)
    out = run_step(s)
    assert [e.req_id for e in out.scheduled] == ["r0", "r1"]
    assert [r.req_id for r in s.waiting] == ["r2"]


def test_preempts_newest_when_blocks_run_out_and_recomputes_it():
    s, bm = make(num_blocks=4, block_size=4, budget=64)
    a, b = add(s, 0, 8), add(s, 1, 8)          # 2 blocks each: cache full after prefill
    run_step(s)
    assert bm.num_free_blocks == 0
    out = run_step(s)                          # a's 9th token needs a 3rd block -> b is preempted
    assert out.preempted == ["r1"]
    assert [e.req_id for e in out.scheduled] == ["r0"]
    assert b.num_computed_tokens == 0 and b.block_table == [] and list(s.waiting) == [b]
    assert b.num_output_tokens == 1            # its sampled token survives preemption
    bm.check_integrity(list(s.requests.values()))
    s.finish_request("r0", "abort")
    out = run_step(s)                          # b comes back: prompt + its output recomputed
    assert out.scheduled[0].req_id == "r1" and len(out.scheduled[0].token_ids) == 9
    bm.check_integrity(list(s.requests.values()))


def test_request_preempts_itself_when_alone_newest():
    s, bm = make(num_blocks=3, block_size=4, budget=64)
    a, b = add(s, 0, 4), add(s, 1, 7)
    run_step(s)                                # a: 1 block (+ sampled -> 5 tokens), b: 2 blocks
    out = run_step(s)                          # a needs block 2 -> preempts b (newest), then fits
    assert out.preempted == ["r1"] and [e.req_id for e in out.scheduled] == ["r0"]


def test_length_finish_frees_blocks():
    s, bm = make()
    r = add(s, 0, 3, max_tokens=2)
    run_step(s)
    run_step(s)
    assert r.is_finished and r.finish_reason == "length"
    assert bm.num_free_blocks == bm.num_blocks and not s.has_unfinished()


def test_eos_respects_min_tokens_and_ignore_eos():
    s, _ = make()
    r = Request("x", [1, 2], SamplingParams(max_tokens=10, min_tokens=2), {0})
    s.add_request(r)
    run_step(s, token=0)                       # EOS at 1 output token < min_tokens: keeps going
    assert not r.is_finished
    run_step(s, token=0)
    assert r.is_finished and r.finish_reason == "stop"


def test_prefix_cache_skips_computed_blocks_and_reports_them():
    s, bm = make(block_size=4, budget=64, caching=True)
    a = add(s, 0, 10, max_tokens=1)
    run_step(s)
    assert a.is_finished
    b = add(s, 1, 0, tokens=list(range(1, 9)) + [50, 51, 52])
    out = run_step(s)
    entry = out.scheduled[0]
    assert b.metrics.num_cached_tokens == 8 and entry.start_pos == 8 and entry.token_ids == [50, 51, 52]
    bm.check_integrity(list(s.requests.values()))


def test_preempted_request_recomputes_from_its_own_cached_blocks():
    s, bm = make(num_blocks=5, block_size=4, budget=64, caching=True)
    a, b = add(s, 0, 8), add(s, 1, 0, tokens=list(range(100, 108)))
    run_step(s)                                    # 4 blocks used, 1 free
    run_step(s)                                    # a: 9 tokens -> 3rd block; b: 9 tokens -> needs one: preempted
    assert b.req_id in [r.req_id for r in s.waiting]
    s.finish_request("r0", "abort")
    out = run_step(s)
    entry = out.scheduled[0]
    assert entry.req_id == "r1" and entry.start_pos == 8   # its two full blocks were still cached
    bm.check_integrity(list(s.requests.values()))


def test_priority_policy_admits_and_preempts_by_priority():
    s, bm = make(max_seqs=1, policy="priority")
    add(s, 0, 2, priority=5)
    add(s, 1, 2, priority=1)
    add(s, 2, 2, priority=1)
    out = run_step(s)
    assert [e.req_id for e in out.scheduled] == ["r1"]   # lowest value first, FCFS among equals
    s2, bm2 = make(num_blocks=4, block_size=4, budget=64, policy="priority")
    hi = add(s2, 0, 8, priority=0)
    lo = add(s2, 1, 8, priority=9)
    run_step(s2)
    out = run_step(s2)                             # hi needs a block: lo (lower priority) is preempted
    assert out.preempted == ["r1"] and [e.req_id for e in out.scheduled] == ["r0"]
    s3, _ = make(num_blocks=4, block_size=4, budget=64, policy="priority")
    lo = add(s3, 0, 8, priority=9)
    hi = add(s3, 1, 8, priority=0)
    run_step(s3)
    out = run_step(s3)                             # lo runs first in the batch but is the victim
    assert out.preempted == ["r0"] and [e.req_id for e in out.scheduled] == ["r1"]


def test_same_prefix_requests_wait_for_the_blocks_being_computed():
    s, bm = make(block_size=4, budget=8, caching=True)
    shared = list(range(1, 13))
    a = add(s, 0, 0, tokens=shared + [50, 51])
    b = add(s, 1, 0, tokens=shared + [60, 61])
    c = add(s, 2, 0, tokens=[99] * 6)               # unrelated: not held back
    out = run_step(s)
    # a takes the whole budget; b would compute a's blocks again, so it waits
    assert [e.req_id for e in out.scheduled] == ["r0"]
    assert [r.req_id for r in s.waiting] == ["r1", "r2"]
    out = run_step(s)
    # a's first 8 tokens are cached now: b starts after them instead of from 0
    assert [(e.req_id, e.start_pos, len(e.token_ids)) for e in out.scheduled] == [("r0", 8, 6), ("r1", 8, 2)]
    assert b.metrics.num_cached_tokens == 8 and bm.num_hits == 8 and bm.num_queries == 14 + 14
    bm.check_integrity(list(s.requests.values()))


def _timed_step(s, seconds):
    """A step whose forward pass took `seconds` (the runner's timing, as the pacer reads it), or
    seconds(prompt tokens in the step)."""
    from tokenmill.core.sched_output import StepTiming
    out = s.schedule()
    prompt = sum(len(e.token_ids) for e in out.scheduled if len(e.token_ids) > 1)
    s.update(out, RunnerOutput(sampled={e.req_id: [7] for e in out.scheduled if e.sample},
                               timing=StepTiming(seconds(prompt) if callable(seconds) else seconds, 0)))
    return out


def test_long_prompts_are_paced_beside_decoders_by_step_time():
    from tokenmill.core.pacing import MIN_CHUNK
    bm = BlockManager(512, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(8, 256, 4000, long_prefill_slowdown=2.5), bm)
    a = add(s, 0, 8)
    _timed_step(s, 0.3)                      # a's prompt
    for _ in range(3):
        _timed_step(s, 0.2)                  # decode-only steps: 0.2 s each
    assert s.pacer.decode_s == 0.2
    add(s, 1, 1000)                          # a long prompt arrives while a decodes
    sizes = []
    for _ in range(6):
        out = _timed_step(s, lambda prompt: 0.2 + 0.004 * prompt)  # 4 ms per prompt token
        sizes.append(next(len(e.token_ids) for e in out.scheduled if e.req_id == "r1"))
        assert any(e.req_id == "r0" and len(e.token_ids) == 1 for e in out.scheduled)  # a keeps decoding
    # first a small chunk (nothing timed yet), then (2.5 - 1) x 0.2 s / 4 ms = 75 tokens a step
    assert sizes[0] == MIN_CHUNK and sizes[1:] == [75] * 5
    a.params = SamplingParams(max_tokens=1)  # a ends: the long prompt takes the whole budget again
    s.finish_request("r0", "length")
    out = _timed_step(s, 1.0)
    assert [len(e.token_ids) for e in out.scheduled] == [256]


def test_prompts_within_the_budget_and_unpaced_configs_take_the_budget():
    bm = BlockManager(512, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(8, 64, 4000, long_prefill_slowdown=3), bm)
    add(s, 0, 8)
    _timed_step(s, 0.3)
    _timed_step(s, 0.2)
    add(s, 1, 60)                            # within the budget: admitted whole beside the decoder
    out = _timed_step(s, 0.5)
    assert sorted(len(e.token_ids) for e in out.scheduled) == [1, 60]
    s2, _ = make(budget=64)                  # pacing off (the core's default): chunks of the budget
    add(s2, 0, 8)
    run_step(s2)
    add(s2, 1, 200)
    out = run_step(s2)
    assert sorted(len(e.token_ids) for e in out.scheduled) == [1, 63]
    import pytest
    with pytest.raises(ValueError, match="long_prefill_slowdown"):
        SchedulerConfig(long_prefill_slowdown=0.5)


def _pooled(s, i, n, tokens=None):
    from tokenmill.pooling_params import PoolingParams

    r = Request(f"p{i}", tokens or list(range(1, n + 1)), SamplingParams(max_tokens=1), set(), pooling=PoolingParams())
    s.add_request(r)
    return r


def _pool_step(s):
    out = s.schedule()
    done = s.update(out, RunnerOutput(sampled={e.req_id: [7] for e in out.scheduled if e.sample},
                                      pooled={e.req_id: [float(len(e.token_ids))] for e in out.scheduled if e.pool}))
    return out, done


def test_a_pooling_request_prefills_in_chunks_pools_once_and_frees_its_blocks():
    s, bm = make(budget=10, caching=True)
    g = add(s, 0, 6)
    p = _pooled(s, 1, 25, list(range(100, 125)))
    steps = [_pool_step(s) for _ in range(4)]
    assert [[(e.req_id, len(e.token_ids), e.sample, e.pool) for e in out.scheduled] for out, _ in steps] == [
        [("r0", 6, True, False), ("p1", 4, False, False)],
        [("r0", 1, True, False), ("p1", 9, False, False)],
        [("r0", 1, True, False), ("p1", 9, False, False)],
        [("r0", 1, True, False), ("p1", 3, False, True)]]
    assert p.is_finished and p.finish_reason == "stop" and p.pooled == [3.0]
    assert p.num_output_tokens == 0 and not p.block_table and p.metrics.first_token_time is not None
    assert (p, 0) in steps[-1][1]
    assert len(bm.cached) >= 6  # its 6 full blocks stay cached for later prefixes
    bm.check_integrity([g])
    again = _pooled(s, 2, 25, list(range(100, 125)))
    out, _ = _pool_step(s)
    assert [(e.req_id, e.start_pos, len(e.token_ids), e.pool) for e in out.scheduled if e.req_id == "p2"] == \
        [("p2", 24, 1, True)]
    assert again.is_finished


def test_whole_prompts_run_in_one_step_or_wait():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(8, 16, 16, whole_prompts=True), bm)
    a, b, c = _pooled(s, 0, 10), _pooled(s, 1, 8), _pooled(s, 2, 3)
    out, _ = _pool_step(s)
    assert [(e.req_id, len(e.token_ids), e.pool) for e in out.scheduled] == [("p0", 10, True)]  # p1 does not fit
    out, _ = _pool_step(s)
    assert [(e.req_id, len(e.token_ids)) for e in out.scheduled] == [("p1", 8), ("p2", 3)]
    assert a.is_finished and b.is_finished and c.is_finished and bm.num_free_blocks == 64
