"""Constrained decoding (server/constraints.py) on the embedded model: JSON schemas, any
JSON object and Hermes tool calls held by llguidance's token masks; the closing guard that
makes a small model's output parse within its token limit; and the request errors.
(The live server's response_format and tool_choice are tested in test_server.py.)"""
import json

import jsonschema
import numpy as np
import pytest

from xlr_jax.errors import InvalidRequestError
from xlr_jax.server.constraints import (Grammars, response_format_constraint,
                                        tool_choice_constraint)
from xlr_jax.server.tool_calls import parse_whole

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}}
ITEMS = {"type": "object", "required": ["items"],
         "properties": {"items": {"type": "array", "items": {"type": "string"}},
                        "done": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {
             "name": "get_weather",
             "parameters": {"type": "object", "required": ["city"],
                            "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {
             "name": "add", "parameters": {"type": "object", "required": ["a", "b"],
                                           "properties": {"a": {"type": "number"},
                                                          "b": {"type": "number"}}}}}]
PROMPTS = ["Describe Paris as a JSON object.", "List three fruits.",
           "What is the weather in Oslo?", "Say hello."]


@pytest.fixture(scope="module")
def grammars(model):
    return Grammars(model.tokenizer, model.engine.config.vocab_size)


def chat(model, text: str) -> list[int]:
    return model.encode([{"role": "user", "content": text}])[0]


@pytest.mark.parametrize("schema", [CITY, ITEMS], ids=["city", "items"])
def test_output_is_valid_under_the_schema_every_time(model, grammars, schema):
    """Greedy and sampled, on four prompts: every output parses and validates."""
    for i, prompt in enumerate(PROMPTS):
        for temperature in (0.0, 1.0):
            c = grammars.json_schema(schema, 48)
            out = model.generate(chat(model, prompt), max_tokens=48, temperature=temperature,
                                 seed=i, logits_processor=c)
            jsonschema.validate(json.loads(out.text), schema)
            assert out.finish_reason == "stop", (prompt, out.text)


def test_a_json_object_with_any_keys(model, grammars):
    out = model.generate(chat(model, PROMPTS[0]), max_tokens=40,
                         logits_processor=grammars.json_object(40))
    assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("max_tokens", [8, 12, 20])
def test_output_closes_within_a_short_budget(model, grammars, max_tokens):
    """The last tokens of the budget close the object: it parses, within max_tokens."""
    c = grammars.json_schema(ITEMS, max_tokens)
    out = model.generate(chat(model, PROMPTS[1]), max_tokens=max_tokens, temperature=1.0,
                         seed=max_tokens, logits_processor=c)
    assert len(out.token_ids) <= max_tokens
    jsonschema.validate(json.loads(out.text), ITEMS)


def test_a_repeated_token_closes_the_value(model, grammars):
    """Greedy, the embedded model writes this population as an endless run of one digit;
    LOOP_TOKENS repeats close it long before the 400-token budget."""
    c = grammars.json_schema(CITY, 400)
    out = model.generate(chat(model, PROMPTS[0]), max_tokens=400, logits_processor=c)
    jsonschema.validate(json.loads(out.text), CITY)
    assert len(out.token_ids) < 100


def test_tool_choice_required_gives_one_call_of_a_listed_tool(model, grammars):
    for i, prompt in enumerate(PROMPTS):
        c = tool_choice_constraint(grammars, TOOLS, "required", 64)
        out = model.generate(chat(model, prompt), max_tokens=64, temperature=1.0, seed=i,
                             logits_processor=c)
        content, calls = parse_whole(out.text)
        assert not content and len(calls) == 1, out.text
        spec = next(t["function"] for t in TOOLS if t["function"]["name"] == calls[0].name)
        jsonschema.validate(json.loads(calls[0].arguments), spec["parameters"])


def test_a_named_tool_choice_calls_that_tool(model, grammars):
    choice = {"type": "function", "function": {"name": "add"}}
    c = tool_choice_constraint(grammars, TOOLS, choice, 64)
    out = model.generate(chat(model, PROMPTS[2]), max_tokens=64, logits_processor=c)
    _, calls = parse_whole(out.text)
    assert [call.name for call in calls] == ["add"]


def test_the_mask_is_a_function_of_the_ids(model, grammars):
    """Asked again for fewer or other ids (the engine may), the constraint rolls back:
    the same bias as a fresh constraint's for those ids."""
    ids = model.tokenizer.encode('{"city":"Rome","population":12', add_special_tokens=False)
    c = grammars.json_schema(CITY, 100)
    for n in (len(ids), 3, len(ids), 5):
        fresh = grammars.json_schema(CITY, 100)
        np.testing.assert_array_equal(c(ids[:n]), fresh(ids[:n]))
    allowed = c(ids) == 0
    digit = model.tokenizer.encode("7", add_special_tokens=False)[0]
    quote = model.tokenizer.encode('"', add_special_tokens=False)[0]
    assert allowed[digit] and not allowed[quote]
    assert c.masks > 0 and c.mask_seconds > 0


def test_a_token_outside_the_grammar_fails_its_request(model, grammars):
    """An object starts with "{": a word first breaks the grammar (the engine then ends
    that request alone, as for any failing logits_processor)."""
    word = model.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(ValueError, match="breaks the output grammar"):
        grammars.json_schema(CITY, 100)(word)


def test_request_errors_name_the_problem(grammars):
    with pytest.raises(InvalidRequestError, match="needs tools"):
        tool_choice_constraint(grammars, [], "required", 10)
    with pytest.raises(InvalidRequestError, match="not among the request's tools"):
        tool_choice_constraint(grammars, TOOLS, {"type": "function",
                                                 "function": {"name": "nope"}}, 10)
    with pytest.raises(InvalidRequestError, match='"json_schema": '):
        response_format_constraint(grammars, {"type": "json_schema"}, 10)
    with pytest.raises(InvalidRequestError, match="does not compile"):
        grammars.json_schema({"type": "object", "properties": {"a": {"type": "nope"}}}, 10)
    assert tool_choice_constraint(grammars, TOOLS, "auto", 10) is None
    assert response_format_constraint(grammars, {"type": "text"}, 10) is None


def test_a_constrained_request_does_not_speculate(model, grammars):
    with pytest.raises(InvalidRequestError, match="does not speculate"):
        model.generate(chat(model, PROMPTS[0]), max_tokens=8,
                       logits_processor=grammars.json_object(8),
                       speculative={"method": "exact", "draft": "ngram"})
