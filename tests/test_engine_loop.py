"""The always-on loop: many caller threads, requests joining a running batch,
cancellation, a bounded queue and shutdown, on the embedded model."""
import asyncio
import gc
import threading
import time

import numpy as np
import pytest

import xlr_jax
from xlr_jax.errors import QueueFullError, XlrError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are"]
SELF_DRAFT = {"method": "exact", "draft": "self:20", "gamma": 2}
NGRAM = {"method": "exact", "draft": "ngram", "gamma": 4}
SMC = {"method": "smc", "draft": "self:26", "gamma": 2, "particles": 2, "min_agreement": 0}


def _request(i: int) -> dict:
    """The i-th request of the mix: greedy, seeded sampling, exact SD (n-gram and
    self-draft) and SMC with a fixed particle count."""
    kinds = [dict(), dict(temperature=0.8, seed=i), dict(speculative=NGRAM),
             dict(speculative=SELF_DRAFT), dict(temperature=0.8, seed=i, speculative=SMC)]
    return dict(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=10, ignore_eos=True,
                **kinds[i % len(kinds)])


def _generate(model, request: dict):
    args = dict(request)
    return model.generate(args.pop("prompt"), **args)


def _idle(model) -> dict:
    stats = model.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["pages_held"] == 0, "a request kept pages after it ended"
    return stats


def test_threads_get_what_each_request_gets_alone(model):
    """16 threads x 2 requests of every kind at once (twice the rows a step holds): each
    output equals its solo run."""
    requests = [_request(i) for i in range(32)]
    solo = [_generate(model, r).token_ids for r in requests]
    got: dict[int, list[int]] = {}
    errors = []

    def caller(t: int):
        try:
            for i in range(t, 32, 16):
                got[i] = _generate(model, requests[i]).token_ids
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not errors, errors
    assert [got[i] for i in range(32)] == solo
    _idle(model)


def test_a_newcomer_joins_a_running_stream(model):
    """A request submitted while another streams finishes before the stream does."""
    stream = model.submit("Write a long story about a dragon.", max_tokens=60, ignore_eos=True)
    newcomer = None
    seen_while_streaming = False
    for n, _ in enumerate(stream.tokens()):
        if n == 2:
            newcomer = model.submit("Hello", max_tokens=4, ignore_eos=True)
        # both are set by the loop thread: a witness that the newcomer ended first
        seen_while_streaming |= newcomer is not None and newcomer.done and not stream.done
    assert seen_while_streaming, "the newcomer waited for the running stream to end"
    assert newcomer.result().token_ids == model.generate("Hello", max_tokens=4,
                                                         ignore_eos=True).token_ids
    assert stream.result().finish_reason == "length"


def test_speculation_runs_beside_other_requests(model):
    """While a long SMC request runs, a plain request, a second SMC request and an
    exact-speculation one submitted after it all end before it does (one loop runs every
    kind, several SMC requests at once), and each output equals its solo run."""
    first = dict(prompt=PROMPTS[0], max_tokens=64, ignore_eos=True, temperature=0.8, seed=1,
                 speculative=SMC)
    others = [dict(prompt=PROMPTS[1], max_tokens=6, ignore_eos=True),
              dict(prompt=PROMPTS[2], max_tokens=6, ignore_eos=True, temperature=0.8, seed=2,
                   speculative=SMC),
              dict(prompt=PROMPTS[3], max_tokens=6, ignore_eos=True, speculative=SELF_DRAFT)]
    solo = [_generate(model, r).token_ids for r in [first, *others]]
    args = dict(first)
    running = model.submit(args.pop("prompt"), **args)
    deadline = time.monotonic() + 60
    while model.stats()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # admitted: the loop is busy with it
    handles = []
    for r in others:
        args = dict(r)
        handles.append(model.submit(args.pop("prompt"), **args))
    got = [h.result().token_ids for h in handles]
    assert not running.done, "a request waited for the running SMC request to end"
    assert [running.result().token_ids, *got] == solo
    _idle(model)


def test_smc_requests_share_their_cycles(model):
    """SMC requests of one configuration running at once are the rows of one batched cycle
    (a target pass for all their particles): together they take fewer cycles than alone,
    and each output equals its solo run."""
    reqs = [dict(prompt=PROMPTS[i], max_tokens=12, ignore_eos=True, temperature=0.8,
                 seed=i, speculative=SMC) for i in (0, 1)]

    def cycles(run) -> tuple[int, list]:
        before = model.stats()["speculative"]["cycles"]
        out = run()
        return model.stats()["speculative"]["cycles"] - before, out

    alone = [cycles(lambda r=r: _generate(model, r).token_ids) for r in reqs]

    def together():
        handles = []
        for r in reqs:
            args = dict(r)
            handles.append(model.submit(args.pop("prompt"), **args))
        return [h.result().token_ids for h in handles]

    shared, got = cycles(together)
    assert got == [tokens for _, tokens in alone]
    assert shared < sum(n for n, _ in alone), (shared, [n for n, _ in alone])
    _idle(model)


def _stream_with_a_long_newcomer(model, word: str) -> tuple[list[float], float, float]:
    """Stream 48 tokens; after the 5th, submit a 2,000-token prompt (made of `word`s).
    Returns the stream's token times, when the newcomer was submitted and when its first
    token came."""
    text = " ".join(f"{word}{i} is a word" for i in range(500))
    long_prompt = model.engine.tokenizer.encode(text)[:2000]
    stream = model.submit("Write a long story about a dragon.", max_tokens=48, ignore_eos=True)
    times, long = [], None
    for n, _ in enumerate(stream.tokens()):
        times.append(time.perf_counter())
        if n == 4:
            long = model.submit(long_prompt, max_tokens=2, ignore_eos=True)
            submitted = time.perf_counter()
    return times, submitted, submitted + long.result().metrics["ttft_s"]


def test_a_long_prompt_does_not_stall_a_running_stream(model):
    """A 2,000-token prompt arriving mid-stream is prefilled chunk by chunk beside the
    stream's decode steps: the stream's largest gap between tokens stays one step with
    one chunk in it, far below the whole prefill (which it would wait for otherwise)."""
    _stream_with_a_long_newcomer(model, "v")  # compiles the steps' shapes (another prompt)
    times, submitted, first_token = _stream_with_a_long_newcomer(model, "w")
    chunks = -(-2000 // model.engine.buckets.chunk[-1])
    during = [t for t in times if submitted < t <= first_token]
    gaps = np.diff([t for t in times if t > submitted])
    # every chunk's step carried a token of the stream
    assert len(during) >= chunks - 1, (len(during), chunks)
    # one chunk's step, measured: the prefill's time shared by its chunks (x2 for jitter)
    prefill = first_token - submitted
    assert gaps.max() < 2 * prefill / chunks, (gaps.max(), prefill)


def test_cancel_close_and_drop_give_pages_back(model):
    handle = model.submit("Count to one hundred:", max_tokens=200, ignore_eos=True)
    tokens = handle.tokens()
    next(tokens), next(tokens)
    handle.cancel()
    result = handle.result(timeout=60)
    assert result.finish_reason == "abort" and 2 <= len(result.token_ids) < 200

    stream = model.stream("Count to one hundred:", max_tokens=200, ignore_eos=True)
    next(stream)
    stream.close()  # the request ends with the iterator

    dropped = model.submit("Count to one hundred:", max_tokens=200, ignore_eos=True)
    next(iter(dropped))
    del dropped
    gc.collect()
    # a request still running would hold pages; the loop ends the two above at its next step
    for _ in range(200):
        if model.stats()["running"] == 0:
            break
    _idle(model)


def test_generate_inside_a_stream(model):
    replies = []
    for piece in model.stream("The sky is", max_tokens=4, ignore_eos=True):
        replies.append(model.generate("The sea is", max_tokens=3, ignore_eos=True).text)
    assert len(replies) >= 1 and len(set(replies)) == 1


def test_asyncio_adapters(model):
    async def both():
        result = await model.agenerate("The sky is", max_tokens=6, ignore_eos=True)
        pieces = [p async for p in model.astream("The sky is", max_tokens=6, ignore_eos=True)]
        return result, pieces

    result, pieces = asyncio.run(both())
    expected = model.generate("The sky is", max_tokens=6, ignore_eos=True)
    assert result.token_ids == expected.token_ids
    assert "".join(pieces) == expected.text


def test_full_queue_and_shutdown(cache_dir):
    """Past max_waiting, QueueFullError at once; shutdown ends everything with "abort"
    and every page comes back."""
    model = xlr_jax.load_model("smollm2", dtype="float32", cache_dir=cache_dir, max_waiting=2)
    assert model.plan.max_waiting == 2
    running = model.submit("Count to one hundred:", max_tokens=200, ignore_eos=True)
    next(iter(running))  # running now, not waiting
    # another kind waits until the running loop drains
    queued = [model.submit("Hi", max_tokens=50, speculative=NGRAM) for _ in range(2)]
    with pytest.raises(QueueFullError, match="max_waiting 2"):
        model.submit("Hi", max_tokens=5)
    model.shutdown()
    assert running.result(timeout=60).finish_reason == "abort"
    assert [q.result(timeout=60).finish_reason for q in queued] == ["abort", "abort"]
    pool = model.engine.kv.pool
    assert int((pool.refcounts[1:] > 0).sum()) == 0
    with pytest.raises(XlrError, match="shut down"):
        model.generate("Hi", max_tokens=2)


@pytest.fixture
def debug_checks(monkeypatch):
    """Check the page pool's invariants after every step of the engines loaded here."""
    monkeypatch.setenv("XLR_DEBUG_CHECKS", "1")


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, seed=5)],
                         ids=["greedy", "sampled"])
def test_preempted_requests_give_the_same_tokens(tiny_models, cache_dir, debug_checks,
                                                 sampling):
    """A pool too small for 6 requests of 40 tokens at once: requests are admitted on
    need, the newest preempted when a step runs short and resumed later, and every
    output equals the one a pool with room for all gives. The pool's invariants hold
    after every step (debug checks)."""
    def load(num_pages):
        return xlr_jax.load_model(str(tiny_models.target), dtype="float32", page_size=4,
                                  num_pages=num_pages, cache_dir=cache_dir)

    prompts = [[1, 2, 3, 4, 5, 6, 7], [2, 3, 4], [5, 5, 5, 5, 5, 1], [7, 6, 5, 4, 3, 2, 1],
               [3, 3, 1], [6, 2, 6, 2, 6]]
    roomy, tight = load(200), load(16)
    expected = roomy.generate(prompts, max_tokens=40, ignore_eos=True, **sampling)
    got = tight.generate(prompts, max_tokens=40, ignore_eos=True, **sampling)
    assert tight.engine.scheduler.preemptions > 0, "the pool was meant to force preemptions"
    # a resumed request's prefix-cache count is its first admission's: the whole prompt
    assert [r.metrics["prefilled_tokens"] for r in got] == [len(p) for p in prompts]
    assert max(r.metrics["preemptions"] for r in got) <= 2  # then a request is protected
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.text for r in got] == [r.text for r in expected]
    # a request larger than the whole pool runs until the pool is full, then ends
    alone = tight.generate([1, 2, 3], max_tokens=200, ignore_eos=True, **sampling)
    assert alone.finish_reason == "length" and 40 < len(alone.token_ids) < 200
    assert alone.token_ids == roomy.generate([1, 2, 3], max_tokens=len(alone.token_ids),
                                             ignore_eos=True, **sampling).token_ids
    assert tight.stats()["pages_held"] == 0


def test_stop_token_ids_end_a_request_like_eos(model):
    free = model.generate("The capital of France is", max_tokens=12, ignore_eos=True)
    stop_at = free.token_ids[4]
    cut = free.token_ids.index(stop_at) + 1
    r = model.generate("The capital of France is", max_tokens=12, ignore_eos=True,
                       stop_token_ids=[stop_at])
    assert r.finish_reason == "stop" and r.token_ids == free.token_ids[:cut]
    assert r.text == model.tokenizer.decode(free.token_ids[:cut - 1])
    with pytest.raises(xlr_jax.InvalidRequestError, match="outside the vocabulary"):
        model.generate("Hi", stop_token_ids=[10 ** 9])


def test_logprobs_are_the_models_log_softmax(model):
    """logprobs=k: each token's log-probability and the k most likely, equal to the log
    softmax of the prompt's logits at that position; asked for by one request of a
    batch, the others get none and the same tokens."""
    prompt = "The capital of France is"
    plain = model.generate(prompt, max_tokens=6, temperature=0.9, seed=4, ignore_eos=True)
    h = model.submit(prompt, max_tokens=6, temperature=0.9, seed=4, ignore_eos=True,
                     logprobs=3)
    other = model.submit("Once upon a time", max_tokens=6, ignore_eos=True)
    r = h.result()
    assert r.token_ids == plain.token_ids and plain.logprobs is None
    assert other.result().logprobs is None
    ids = model.tokenizer.encode(prompt)
    logits = model.logits(ids + r.token_ids[:-1])[len(ids) - 1:]
    log_p = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    assert [e["token_id"] for e in r.logprobs] == r.token_ids
    for row, token, entry in zip(log_p, r.token_ids, r.logprobs):
        # the prompt's logits come from one prefill, the tokens' from decode steps: f32
        # sums in another order (~2e-3 here)
        assert abs(entry["logprob"] - row[token]) < 1e-2
        top = np.argsort(-row)[:3]
        assert [t["token_id"] for t in entry["top_logprobs"]] == list(top)
        assert np.allclose([t["logprob"] for t in entry["top_logprobs"]], row[top], atol=1e-2)
    with pytest.raises(XlrError, match="logprobs must be in"):
        model.generate(prompt, logprobs=21)
    with pytest.raises(XlrError, match="not reported under speculative"):
        model.generate(prompt, logprobs=1, speculative=NGRAM)


def test_stats_is_one_snapshot_of_the_engine(model):
    """Requests, pages, steps and their time, speculative totals and the prefix cache's
    per-tier counts, moving as requests run."""
    before = model.stats()
    model.generate(PROMPTS[0], max_tokens=4, ignore_eos=True)
    model.generate(PROMPTS[1], max_tokens=6, ignore_eos=True, speculative=NGRAM)
    after = _idle(model)
    assert after["steps"] >= before["steps"] + 4 and after["step_time_s"] > 0
    spec = after["speculative"]
    assert spec["target_passes"] > before["speculative"]["target_passes"]
    assert spec["draft_tokens"] >= spec["accepted_tokens"] >= 0
    assert after["prefix_cache"]["requests"] == before["prefix_cache"]["requests"] + 2
    assert after["prefix_cache"]["volatile_tokens"] > before["prefix_cache"]["volatile_tokens"]
    assert after["preemptions"] == before["preemptions"]
    assert after["pages_free"] + after["pages_cached"] + after["pages_pinned"] <= \
        after["pages_total"]


def test_queue_time_counts_the_wait_for_a_batch_slot(model):
    """metrics["queue_s"]: from submission to first joining the running batch. With one
    request more than the batch holds, the last waits for a slot: longer than the
    first, which joined at once, and never past its own first token."""
    handles = [model.submit(f"Say the number {i}.", max_tokens=12, ignore_eos=True)
               for i in range(model.plan.max_batch + 1)]
    results = [h.result() for h in handles]
    queue = [r.metrics["queue_s"] for r in results]
    assert all(0 <= q <= r.metrics["ttft_s"] for q, r in zip(queue, results))
    assert queue[-1] > queue[0] + 0.05  # it waited at least a step or two


def test_forced_tokens_join_the_output_at_a_step_boundary(model):
    """force() appends tokens as if generated; generation goes on from them, as a request
    whose prompt ended with them would."""
    prompt = "The three primary colors are"
    ids = model.tokenizer.encode(prompt)
    plain = model.generate(prompt, max_tokens=24, ignore_eos=True).token_ids
    forced = model.tokenizer.encode(" Answer:", add_special_tokens=False)
    h = model.submit(prompt, max_tokens=24, ignore_eos=True)
    stream = h.tokens()
    next(stream)
    h.force(forced)
    list(stream)
    out = h.result().token_ids
    k = next(i for i in range(len(out)) if out[i:i + len(forced)] == forced)
    assert k >= 1 and out[:k] == plain[:k], "tokens before the forced ones changed"
    after = model.generate(ids + out[:k + len(forced)], max_tokens=24 - k - len(forced),
                           ignore_eos=True).token_ids
    assert out[k + len(forced):] == after and len(out) == 24
    with pytest.raises(XlrError, match="not running"):
        h.force(forced)  # it ended


def test_each_token_is_drawn_under_its_own_steps_mask(model):
    """A mask that changes every step (5 random tokens allowed at step k), on requests
    decoding beside a plain one, so steps run ahead and the masks come while they run
    (Engine._bias_late): each processor is called once per token with the tokens before
    it, every token is one its step allowed, and greedy tokens are the argmax of the
    prompt's logits plus that step's mask."""
    vocab, n = model.config.vocab_size, 12

    def per_step(calls):
        def processor(generated):
            calls.append(list(generated))
            bias = np.full(vocab, -np.inf, np.float32)
            bias[allowed(len(generated))] = 0.0
            return bias
        return processor

    def allowed(k):
        return np.random.default_rng(100 + k).choice(vocab, 5, replace=False)

    calls = {"greedy": [], "sampled": []}
    greedy = model.submit(PROMPTS[0], max_tokens=n, ignore_eos=True,
                          logits_processor=per_step(calls["greedy"]))
    sampled = model.submit(PROMPTS[1], max_tokens=n, ignore_eos=True, temperature=1.0,
                           seed=4, logits_processor=per_step(calls["sampled"]))
    plain = model.submit(PROMPTS[2], max_tokens=3 * n, ignore_eos=True)
    outs = {"greedy": greedy.result().token_ids, "sampled": sampled.result().token_ids}
    plain.result()
    for name, out in outs.items():  # a prompt's chunk steps may ask for its first mask again
        asked = [c for i, c in enumerate(calls[name]) if not i or c != calls[name][i - 1]]
        assert asked == [out[:k] for k in range(n)], name
        assert all(t in allowed(k) for k, t in enumerate(out)), name
    prompt = model.encode(PROMPTS[0])[0]
    for k, token in enumerate(outs["greedy"]):
        logits = model.logits(prompt + outs["greedy"][:k])[-1]
        ids = allowed(k)
        assert token == ids[np.argmax(logits[ids])], k
    _idle(model)


def test_a_logits_processor_masks_its_request_only(model):
    """A per-step bias from the request's processor: an allow-list mask keeps every token
    in the list (the processor sees the tokens so far); a batch neighbour without one is
    untouched; a processor that raises ends its own request only."""
    allowed = model.tokenizer.encode(" yes no maybe", add_special_tokens=False)
    seen = []

    def only_allowed(generated):
        seen.append(list(generated))
        bias = np.full(model.config.vocab_size, -np.inf, np.float32)
        bias[allowed] = 0.0
        return bias

    def broken(generated):
        raise RuntimeError("grammar state lost")

    neighbour = model.generate(PROMPTS[0], max_tokens=8, ignore_eos=True).token_ids
    masked = model.submit("Is the sky blue?", max_tokens=8, temperature=1.0, seed=2,
                          ignore_eos=True, logits_processor=only_allowed)
    failing = model.submit(PROMPTS[1], max_tokens=8, ignore_eos=True, logits_processor=broken)
    other = model.submit(PROMPTS[0], max_tokens=8, ignore_eos=True)
    out = masked.result().token_ids
    assert len(out) == 8 and set(out) <= set(allowed)
    assert seen[-1] == out[:-1]  # called with the tokens so far, before each draw
    r = failing.result()
    assert r.finish_reason == "abort" and "grammar state lost" in r.metrics["error"]
    assert other.result().token_ids == neighbour
    with pytest.raises(XlrError, match="does not speculate"):
        model.generate(PROMPTS[0], logits_processor=only_allowed, speculative=NGRAM)
    _idle(model)
