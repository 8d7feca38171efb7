"""Thinking (server/reasoning.py) on the embedded model: a prompt that opens a thought,
the budget that closes it at exactly its token count (0 at once), the transition text,
the constraint that takes over for the answer, and the splitter that streams thought and
answer apart at every cut. (The live server's reasoning_content is in test_server.py.)"""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xlr_jax.server.app import chat_message_parts
from xlr_jax.server.constraints import Grammars
from xlr_jax.server.reasoning import (EFFORT_BUDGETS, Markers, ReasoningSplitter,
                                      ThoughtBudget, opens_thought, request_budget,
                                      split_reasoning)

MARKERS = Markers()


def thinking_prompt(model, text: str) -> list[int]:
    """The model's chat prompt with a thought opened, as a thinking template writes it."""
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])
                      + MARKERS.start + "\n")


def budget_for(model, ids, budget, max_tokens, markers=MARKERS, inner=None):
    return ThoughtBudget(model.tokenizer, model.engine.config.vocab_size, markers, budget,
                         opens_thought(model.tokenizer, ids, markers), max_tokens, inner)


@pytest.mark.parametrize("budget", [0, 1, 7, 20])
def test_the_budget_closes_the_thought_at_its_count(model, budget):
    ids = thinking_prompt(model, "Why is the sky blue?")
    assert opens_thought(model.tokenizer, ids, MARKERS)
    thought = budget_for(model, ids, budget, 60)
    out = model.generate(ids, max_tokens=60, temperature=1.0, seed=budget,
                         logits_processor=thought)
    reasoning, _ = split_reasoning(out.text, MARKERS, opened=True)
    assert reasoning == model.tokenizer.decode(out.token_ids[:budget])
    close = model.tokenizer.encode(MARKERS.end, add_special_tokens=False)
    # the thought: `budget` generated tokens, then the end marker's tokens
    assert out.token_ids[budget:budget + len(close)] == close, out.text
    assert thought.thought_tokens == budget + len(close)
    assert thought.answer_from == budget + len(close)
    counter = budget_for(model, ids, None, 60)  # the server's count of a finished answer
    counter.feed(out.token_ids)
    assert counter.thought_tokens == thought.thought_tokens


def test_a_transition_text_follows_a_forced_end(model):
    markers = Markers(transition="\nTime to answer.\n")
    ids = thinking_prompt(model, "Name a fruit.")
    out = model.generate(ids, max_tokens=30, logits_processor=budget_for(
        model, ids, 3, 30, markers))
    reasoning, answer = split_reasoning(out.text, markers, opened=True)
    assert answer.startswith("Time to answer.") and len(reasoning) > 0


def test_no_budget_below_the_count_changes_nothing(model):
    """A thought that ends on its own within the budget is the same as with none."""
    ids = thinking_prompt(model, "Say yes.")
    free = model.generate(ids, max_tokens=24)
    held = model.generate(ids, max_tokens=24, logits_processor=budget_for(model, ids, 500,
                                                                          24))
    assert held.token_ids == free.token_ids


def test_the_answer_after_a_thought_is_held_to_its_schema(model):
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    ids = thinking_prompt(model, "Is water wet? Answer in JSON.")
    grammars = Grammars(model.tokenizer, model.engine.config.vocab_size)
    out = model.generate(ids, max_tokens=40, logits_processor=budget_for(
        model, ids, 5, 40, inner=grammars.json_schema(schema, 40)))
    reasoning, answer = split_reasoning(out.text, MARKERS, opened=True)
    assert reasoning and isinstance(json.loads(answer)["ok"], bool)


def test_a_constraint_holds_the_answer_not_the_thought(model):
    """No budget, a JSON constraint: the thought's tokens are the unconstrained ones; only
    the answer after the end marker is held (the server wraps a constraint so wherever a
    thought can happen)."""
    schema = {"type": "object"}
    ids = thinking_prompt(model, "Name a colour.")
    grammars = Grammars(model.tokenizer, model.engine.config.vocab_size)
    free = model.generate(ids, max_tokens=48)
    thought = budget_for(model, ids, None, 48, inner=grammars.json_schema(schema, 48))
    held = model.generate(ids, max_tokens=48, logits_processor=thought)
    end = thought.answer_from if thought.answer_from is not None else len(held.token_ids)
    assert end > 1 and held.token_ids[:end] == free.token_ids[:end]
    if thought.answer_from is not None:
        _, answer = split_reasoning(held.text, MARKERS, opened=True)
        assert isinstance(json.loads(answer), dict)


def test_a_prompt_without_the_marker_does_not_open_a_thought(model):
    tok = model.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    assert not opens_thought(tok, ids, MARKERS)
    thought = budget_for(model, ids, 0, 10)
    out = model.generate(ids, max_tokens=10, logits_processor=thought)
    assert split_reasoning(out.text, MARKERS, opened=False) == (None, out.text)
    assert thought.thought_tokens == 0


def test_budgets_by_effort_and_precedence():
    assert request_budget("none", None, 99) == 0
    assert request_budget("high", None, 99) == EFFORT_BUDGETS["high"]
    assert request_budget("low", 5, 99) == 5
    assert request_budget(None, None, 99) == 99
    assert request_budget(None, None, None) is None


THOUGHTS = ["<think>\nplan it\n</think>\n\nThe answer.", "<think>only thinking",
            "  <think>a</think>b", "No thought here.", "<thin", "</think>x"]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(THOUGHTS), st.booleans(), st.lists(st.integers(1, 6), max_size=10))
def test_the_splitter_gives_the_same_parts_at_every_cut(text, opened, cuts):
    """Streamed in any pieces, the thought and the answer come out as split whole."""
    splitter = ReasoningSplitter(MARKERS, opened)
    events, at = [], 0
    for n in cuts + [len(text)]:
        events += splitter.feed(text[at:at + n])
        at += n
    events += splitter.finish()
    thought = "".join(t for kind, t in events if kind == "reasoning")
    answer = "".join(t for kind, t in events if kind == "content")
    whole = split_reasoning(text, MARKERS, opened)
    assert (thought if splitter.thought_seen else None, answer) == whole


def test_split_examples():
    assert split_reasoning("<think>\nplan\n</think>\n\nHi", MARKERS, False) == ("plan\n", "Hi")
    assert split_reasoning("plan</think>Hi", MARKERS, True) == ("plan", "Hi")
    assert split_reasoning("still thinking", MARKERS, True) == ("still thinking", "")
    assert split_reasoning("Hi <think>x</think>", MARKERS, False) == \
        (None, "Hi <think>x</think>")


def test_a_call_in_the_thought_is_not_a_tool_call():
    """A whole answer: a <tool_call> block inside the thought stays reasoning text; the
    same block after the thought is a call."""
    block = '<tool_call>{"name": "rm", "arguments": {"path": "/"}}</tool_call>'
    reasoning, content, calls = chat_message_parts(f"maybe {block}</think>No.", MARKERS,
                                                   True, True)
    assert block in reasoning and content == "No." and calls == []
    reasoning, content, calls = chat_message_parts(f"plan</think>{block}", MARKERS, True, True)
    assert reasoning == "plan" and [c.name for c in calls] == ["rm"]
