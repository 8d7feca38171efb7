"""The scheduler without a model: admission, chunking, preemption, prefix sharing, stable-tier
waits, forced tokens and the step's rows, driven by hand-made runner outputs. Each test
runs in milliseconds; the model runs in tests/test_engine_loop.py."""
import ast
from pathlib import Path

import numpy as np
import pytest

from xlr_jax.errors import InvalidRequestError, OutOfPagesError, PromptTooLongError
from xlr_jax.kv.manager import KVManager, PageCopy
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.planning.buckets import buckets_for, step_shape
from xlr_jax.runtime.request import Request, token_budget
from xlr_jax.runtime.scheduler import RunnerOutput, Scheduler

PAGE = 4
CONTEXT = 256


def make_scheduler(num_pages=32, max_batch=4, chunk=16, budget=None, prefix_cache=True,
                   max_preemptions=2, rows_up_to_context=512,
                   separate_prefill=False) -> Scheduler:
    kv = KVManager(num_pages, PAGE, {}, prefix_cache=prefix_cache, namespace="test")
    buckets = buckets_for(max_batch, chunk, -(-CONTEXT // PAGE), dense=True)
    return Scheduler(kv, buckets, max_batch=max_batch,
                     max_step_tokens=budget or max_batch + chunk, step_cost_tokens=0,
                     max_preemptions=max_preemptions, vocab_size=1000, rows_from_streams=3,
                     rows_up_to_context=rows_up_to_context, separate_prefill=separate_prefill)


def make_request(s: Scheduler, index: int, prompt: list[int], max_tokens=8,
                 tiers=(0, 0), **params) -> Request:
    r = Request(index, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                              **params),
                s.kv.new_sequence(), None, CONTEXT, 0.0, tiers)
    s.kv.check_fits(r)
    return r


def token_for(r: Request) -> int:
    """The runner's stand-in: each request draws its index times 100 plus its count."""
    return 100 * (r.index + 1) + len(r.generated)


def fake_result(s: Scheduler, out) -> RunnerOutput:
    """What a runner would read back of `out`: a token per row, the chunk's after every
    (padded) decode row, as the step builder lays them out."""
    rows, _ = step_shape(s.buckets, out.rows, len(out.chunk_tokens))
    sampled = np.zeros(rows + (out.chunk is not None), np.int32)
    for j, r in enumerate(out.decode):
        sampled[j] = token_for(r)
    if out.chunk is not None:
        sampled[rows] = token_for(out.chunk)
    return RunnerOutput(sampled)


def iterate(s: Scheduler):
    """One engine iteration without run-ahead: schedule, the step, its update. Returns
    (the step, its events), events before the step included."""
    out = s.schedule()
    s.kv.take_ops()  # the runner would apply them
    return out, out.events + s.update(out, fake_result(s, out))


def drain(s: Scheduler, limit=500) -> dict:
    """Run until idle; each request's result by index."""
    results = {}
    for _ in range(limit):
        s.drop_ended()
        if s.idle:
            return results
        _, events = iterate(s)
        results.update({i: res for i, _, res in events if res is not None})
    raise AssertionError("the scheduler did not drain")


def held_pages(s: Scheduler) -> int:
    return int((s.kv.pool.refcounts[1:] > 0).sum())


def test_the_scheduler_imports_no_jax():
    """Host policy only: its module and everything of the package it imports, read from
    the sources, import neither jax nor the device modules."""
    root = Path(__file__).parents[1]
    seen, todo = set(), ["xlr_jax.runtime.scheduler"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = root / (name.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            for imported in names:
                assert imported.split(".")[0] not in ("jax", "jaxlib"), f"{name} imports jax"
                if imported.startswith("xlr_jax."):
                    todo.append(imported)
    assert "xlr_jax.kv.manager" in seen and "xlr_jax.runtime.request" in seen


def test_requests_are_admitted_in_order_while_they_fit():
    """Four slots: four of five requests run, the fifth waits for one to finish; every
    request gets its tokens, and every page comes back."""
    s = make_scheduler(max_batch=4)
    reqs = [make_request(s, i, [1, 2, 3, 4, 5], max_tokens=3) for i in range(5)]
    for r in reqs:
        s.add(r)
    s.prepare()
    assert s.running == reqs[:4] and list(s.waiting) == reqs[4:]
    results = drain(s)
    assert sorted(results) == [0, 1, 2, 3, 4]
    for r in reqs:
        assert results[r.index].token_ids == [100 * (r.index + 1) + k for k in range(3)]
    assert held_pages(s) == 0


def test_a_long_prompt_prefills_chunk_by_chunk_beside_decode_rows():
    """A stream decodes while a 40-token prompt arrives: every step carries the stream's
    row and a chunk within the step budget (20 - 1 rows: the 16 bucket, not the 32 it
    would take alone)."""
    s = make_scheduler(max_batch=2, chunk=32, budget=20)
    stream = make_request(s, 0, [7, 7, 7], max_tokens=20)
    s.add(stream)
    iterate(s)  # its prompt
    newcomer = make_request(s, 1, list(range(10, 50)), max_tokens=2)
    s.add(newcomer)
    chunks = []
    while not newcomer.generated:
        out, _ = iterate(s)
        assert out.decode == [stream]
        chunks.append(len(out.chunk_tokens))
    assert chunks == [16, 16, 8]
    assert newcomer.seq.length == 40


def test_alone_a_prompt_takes_whole_chunks():
    s = make_scheduler(max_batch=2, chunk=32, budget=20)
    r = make_request(s, 0, list(range(1, 41)), max_tokens=1)
    s.add(r)
    sizes = []
    while not r.generated:
        out, _ = iterate(s)
        sizes.append(len(out.chunk_tokens))
    assert sizes == [32, 8]


def test_a_short_pool_preempts_the_newest_and_it_resumes_with_its_tokens():
    """Two requests grow past a 5-page pool: the newest gives its pages back, waits at
    the head of the queue and resumes by prefilling what it had; both finish with all
    their tokens, and after max_preemptions it is protected."""
    s = make_scheduler(num_pages=6, max_batch=2, prefix_cache=False, max_preemptions=1)
    old = make_request(s, 0, [1, 2, 3], max_tokens=9)
    new = make_request(s, 1, [4, 5, 6], max_tokens=9)
    s.add(old)
    s.add(new)
    results = drain(s)
    assert s.preemptions >= 1 and new.preemptions >= 1 and old.preemptions == 0
    assert new.protected  # one preemption was its limit
    for r in (old, new):
        assert results[r.index].token_ids == [100 * (r.index + 1) + k for k in range(9)]
    assert held_pages(s) == 0


def test_a_request_nothing_can_make_room_for_ends_at_length():
    s = make_scheduler(num_pages=3, max_batch=1, prefix_cache=False)  # 2 pages: 8 tokens
    r = make_request(s, 0, [1, 2, 3], max_tokens=20)
    s.add(r)
    results = drain(s)
    # 8 slots: the prompt, 5 tokens fed back, and the last one drawn (never fed)
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 6
    assert held_pages(s) == 0


def test_a_request_that_can_never_fit_is_refused_at_once():
    s = make_scheduler(num_pages=3)
    with pytest.raises(PromptTooLongError, match="num_pages"):
        make_request(s, 0, list(range(1, 10)))


def test_admission_that_fails_with_nothing_running_raises():
    s = make_scheduler(num_pages=5, prefix_cache=False)
    r = make_request(s, 0, [1, 2, 3, 4, 5])  # 2 pages
    s.kv.pool.allocate(3)  # pages held by no request the scheduler knows
    s.add(r)
    with pytest.raises(OutOfPagesError, match="KV pages"):
        s.prepare()


def test_a_repeated_prompt_shares_the_cached_pages():
    """The second request of the same 13-token prompt finds its first 12 tokens cached (3
    full pages; one token is left to prefill for its logits) and the same tokens follow."""
    s = make_scheduler()
    prompt = list(range(20, 33))
    first = make_request(s, 0, prompt, max_tokens=2)
    s.add(first)
    drain(s)
    second = make_request(s, 0, prompt, max_tokens=2)
    s.add(second)
    out, _ = iterate(s)
    assert second.cached_tokens == 12 and out.chunk_tokens == prompt[12:]
    assert out.chunk_start == 12


def test_a_request_sharing_a_stable_tier_waits_for_it_to_be_written():
    """Two agents on one 10-token system prompt: the second is not admitted while the
    first prefills that tier, then shares it whole."""
    s = make_scheduler(chunk=16, max_batch=4)
    system = list(range(100, 110))
    a = make_request(s, 0, system + [1, 2, 3, 4, 5, 6, 7, 8, 9], tiers=(10, 10))
    b = make_request(s, 1, system + [9, 8, 7], tiers=(10, 10))
    s.add(a)
    s.add(b)
    out, _ = iterate(s)
    assert s.running == [a] and list(s.waiting) == [b]
    assert out.chunk_tokens == system  # a chunk ends at the tier's end
    iterate(s)
    assert b in s.running and b.cached_tokens == 10


def test_forced_tokens_join_the_output_before_the_next_step():
    s = make_scheduler()
    r = make_request(s, 0, [1, 2, 3], max_tokens=6)
    s.add(r)
    iterate(s)
    s.force(r, [555, 556])
    out, events = iterate(s)
    assert r.generated[:3] == [100, 555, 556]
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        s.force(r, [10 ** 6])


def test_run_ahead_only_for_the_same_decode_rows_with_nobody_joining():
    s = make_scheduler(max_batch=2)
    a = make_request(s, 0, [1, 2, 3], max_tokens=10)
    s.add(a)
    out, _ = iterate(s)  # its prompt: a chunk
    assert not s.can_run_ahead(out)
    out, _ = iterate(s)
    assert out.decode == [a] and s.can_run_ahead(out)
    s.add(make_request(s, 1, [4, 5], max_tokens=2))
    assert not s.can_run_ahead(out)  # a newcomer may join


def test_apart_a_prompt_takes_whole_chunks_one_at_a_time_beside_the_decode_steps():
    """Prefill on devices of its own: the chunk is a step of its own (whole chunks: the
    step budget binds only a shared step), the decode steps carry no chunk and run ahead
    while it runs, and the next chunk waits for the last one's update; the prompt's
    first token is its last chunk's row, and then it decodes beside the stream."""
    s = make_scheduler(max_batch=2, chunk=32, budget=20, prefix_cache=False,
                       separate_prefill=True)
    stream = make_request(s, 0, [7, 7, 7], max_tokens=20)
    s.add(stream)
    out = s.schedule()  # its prompt, apart
    assert not out.runs and out.prefill.chunk is stream and s.prefilling is stream
    s.update(out.prefill, fake_result(s, out.prefill))
    assert s.prefilling is None and stream.generated == [100]
    newcomer = make_request(s, 1, list(range(10, 50)), max_tokens=2)
    s.add(newcomer)
    chunks, prefill = [], None
    while not newcomer.generated:
        out = s.schedule()
        assert out.decode == [stream] and out.chunk is None
        if prefill is not None:  # the last chunk not taken yet: no other starts
            assert out.prefill is None and s.prefilling is newcomer
            assert s.can_run_ahead(out)  # only the prefilling request is not a row
            s.update(prefill, fake_result(s, prefill))
            prefill = None
        else:
            prefill = out.prefill
            chunks.append(len(prefill.chunk_tokens))
            assert prefill.decode == [] and prefill.chunk is newcomer
        s.update(out, fake_result(s, out))
    assert chunks == [32, 8] and newcomer.generated == [200]
    out = s.schedule()
    assert out.decode == [stream, newcomer] and out.prefill is None


def test_apart_a_preempted_request_takes_no_row_before_its_last_chunk_is_read_back():
    """Prefill apart, each chunk's step read back one iteration late (as the engine does
    while decode steps run): requests preempted by a 5-page pool resume (their last
    chunk makes them decoding again as it is dispatched) but take decode rows only once
    that chunk is read back; every request ends with all its tokens."""
    s = make_scheduler(num_pages=6, max_batch=2, prefix_cache=False, max_preemptions=1,
                       separate_prefill=True)
    reqs = [make_request(s, i, [1 + 3 * i, 2, 3], max_tokens=9) for i in range(2)]
    for r in reqs:
        s.add(r)
    results, pending = {}, None
    for _ in range(200):
        s.drop_ended()
        if s.idle and pending is None:
            break
        out = s.schedule()
        assert s.prefilling is None or s.prefilling not in out.decode
        events = out.events + s.update(out, fake_result(s, out))
        if pending is not None:
            events += s.update(pending, fake_result(s, pending))
        pending = out.prefill
        results.update({i: res for i, _, res in events if res is not None})
    assert s.preemptions >= 1
    for r in reqs:
        assert results[r.index].token_ids == [100 * (r.index + 1) + k for k in range(9)]
    assert held_pages(s) == 0


def test_step_rows_carry_positions_pages_and_draw_counts():
    """Each decode row feeds its last token at its next position, over its own pages,
    drawing its next token; its pages are reserved before the step."""
    s = make_scheduler()
    r = make_request(s, 0, [1, 2, 3, 4, 5], max_tokens=9)
    s.add(r)
    iterate(s)
    iterate(s)
    out = s.step([r])
    assert out.tokens == [r.generated[-1]] and out.positions == [6]
    assert out.draws == [2] and out.tables[0][:2].tolist() == r.seq.pages[:2]
    assert r.seq.length == 7


def test_a_failing_logits_processor_ends_its_request_alone():
    def broken(ids):
        raise RuntimeError("boom")

    s = make_scheduler()
    good = make_request(s, 0, [1, 2, 3], max_tokens=3)
    bad = make_request(s, 1, [1, 2, 3], max_tokens=3, logits_processor=broken)
    s.add(good)
    s.add(bad)
    results = drain(s)
    assert results[1].finish_reason == "abort" and "boom" in results[1].metrics["error"]
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 3


def test_a_shared_partial_page_is_copied_before_it_is_written():
    """A request whose prompt ends mid-page shares that page from the cache; its first
    write there queues a copy-on-write for the device."""
    s = make_scheduler()
    prompt = list(range(40, 46))  # one full page and 2 tokens
    s.add(make_request(s, 0, prompt, max_tokens=1))
    drain(s)
    s.kv.take_ops()
    again = make_request(s, 1, prompt + [99], max_tokens=1)
    s.add(again)
    s.prepare()
    ops = s.kv.take_ops()
    assert again.cached_tokens == 6
    assert any(isinstance(op, PageCopy) for op in ops)


def test_aborting_a_waiting_request_gives_its_result_and_pages():
    s = make_scheduler(max_batch=1)
    a, b = make_request(s, 0, [1, 2]), make_request(s, 1, [3, 4])
    s.add(a)
    s.add(b)
    iterate(s)
    result = s.abort(b)
    assert result.finish_reason == "abort" and b not in s.waiting
    assert held_pages(s) == len(a.seq.pages) > 0  # a still runs


def test_a_token_budget_is_what_was_asked_within_the_cap_and_the_context():
    assert token_budget(100, 256) == 156  # nothing asked: all the context holds
    assert token_budget(100, 256, asked=20) == 20
    assert token_budget(100, 256, asked=500) == 156
    assert token_budget(100, 256, asked=50, cap=30) == 30  # a server's default caps it
    assert token_budget(100, 256, cap=30) == 30
    s = make_scheduler(num_pages=80)
    assert make_request(s, 0, [1] * 250, max_tokens=100).limit == CONTEXT - 250


def test_speculation_verifies_as_rows_where_the_plan_says_rows_pay():
    """A speculating request verifies as rows of the step beside a chunk, beside
    rows_from_streams plain streams, or at a context of at most rows_up_to_context tokens;
    otherwise, and alone, it runs a cycle of its own."""
    from xlr_jax.speculative.config import SpecConfig

    def scheduler_with(plain: int, prompt: int):
        s = make_scheduler(num_pages=64, max_batch=4, rows_up_to_context=8)
        spec = make_request(s, 0, list(range(1, prompt + 1)), max_tokens=40)
        spec.spec = SpecConfig(method="exact", draft="ngram")
        for r in [spec] + [make_request(s, i + 1, [7, 8], max_tokens=20) for i in range(plain)]:
            s.add(r)
        while any(not r.generated for r in s.running) or s.waiting:
            iterate(s)  # prefill them all (the stand-in runner decodes every row)
        s.prepare()
        return s.plan(), spec

    plan, spec = scheduler_with(plain=1, prompt=20)  # a long context beside one stream
    assert plan.steps and spec in plan.speculating and spec not in plan.rows
    plan, spec = scheduler_with(plain=3, prompt=20)  # beside three
    assert spec in plan.rows
    plan, spec = scheduler_with(plain=1, prompt=4)  # a short context
    assert spec in plan.rows
    plan, spec = scheduler_with(plain=0, prompt=4)  # alone: no step, its own cycle
    assert not plan.steps and plan.rows == [] and plan.speculating == [spec]


def test_schedule_asks_for_the_rows_drafts_and_leaves_the_rest_to_cycles():
    """`schedule` puts a speculating request's proposal in the step's rows when the plan
    verifies it there, and leaves it to a cycle when its proposer does; alone, it is a
    cycle with no step."""
    from xlr_jax.speculative.config import SpecConfig
    from xlr_jax.speculative.proposals import Proposal

    s = make_scheduler(num_pages=64, max_batch=4)
    spec = make_request(s, 0, [1, 2, 3, 4], max_tokens=40)
    spec.spec = SpecConfig(method="exact", draft="ngram")
    streams = [make_request(s, 1, [7, 8], max_tokens=20)]  # beside it: rows pay (its context)
    for r in [spec, *streams]:
        s.add(r)
    while any(not r.generated for r in s.running) or s.waiting:
        iterate(s)
    asked = []

    def verify_rows(plan):
        asked.append(list(plan.rows))
        return [Proposal(spec, [5, 6])], []

    start = spec.seq.length
    out = s.schedule(verify_rows)
    assert asked == [[spec]] and out.runs and out.cycles == []
    assert out.decode == streams and [p.request for p, _, _ in out.verify] == [spec]
    assert out.tokens[1:] == [spec.generated[-1], 5, 6]  # its last token, then its drafts
    s.update(out, fake_result(s, out))
    spec.seq.trim(start + 1)  # the verdict (SpecRunner.take_verified): both drafts
    spec.accept(42, 0.0)      # rejected, another token in their place
    out = s.schedule(lambda plan: ([], list(plan.rows)))  # its proposer gives it a cycle
    assert out.cycles == [spec] and not out.verify and out.decode == streams
    assert out.promised == s.kv.owed_to(s.running)
    for r in streams:
        s.abort(r)
    s.drop_ended()
    out = s.schedule(verify_rows)
    assert not out.runs and out.cycles == [spec] and len(asked) == 1
