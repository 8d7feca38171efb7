"""Constrained decoding: output held to a grammar (a JSON schema, any JSON object, or a
Hermes-format tool call) by a token mask that llguidance computes per step.

A `Constraint` is a request's `logits_processor`: given the token ids generated so far,
it returns a bias that is 0 on the tokens the grammar allows next and -inf elsewhere
(EOS only once the grammar is complete). Two guards make a small model's output parse
every time rather than run into its token limit mid-object:

- **Closing.** In its last `reserve` tokens (or once it has repeated one token
  `LOOP_TOKENS` times, a greedy small model's way of writing an endless number), the
  mask keeps only the first of CLOSERS the grammar allows: EOS, then the characters
  that end a string, object or array, then the shortest values. Where none is allowed
  (inside a required key's name, a literal tag), the model picks among the allowed
  tokens.
- **A request with a mask does not speculate**: the engine refuses the combination,
  since a draft's proposals would be checked against unmasked probabilities.

`Grammars(tokenizer, vocab_size)` builds llguidance's view of the tokenizer once
(about 1 s) and makes each request's Constraint (a grammar compiles in milliseconds).
"""
from __future__ import annotations

import json
import time

import llguidance
import llguidance.numpy as llnp
import numpy as np

from xlr_jax.errors import InvalidRequestError
from xlr_jax.loading.prompts import shared_prefix
from xlr_jax.server.tool_calls import CLOSE, OPEN

# What a closing constraint prefers after EOS, in order (the text of single tokens). A
# quote first: inside a string it is the only way out ("}" there is just a character);
# elsewhere it starts a string the next step closes. "," before "0": inside a number
# that cannot end yet (a required key still to come), a digit would go on forever.
CLOSERS = ('"', "}", "]", ",", "0", "false", "null", ":", "{", "[")
LOOP_TOKENS = 16     # one token this many times in a row: close
MAX_RESERVE = 32     # tokens kept for closing at the end of the budget


class Grammars:
    """Constraints for one tokenizer: llguidance's tokenizer view, built once."""

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_ids = sorted(tokenizer.eos_token_ids)
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend_json(), n_vocab=vocab_size, eos_token=self.eos_ids)
        single = (tokenizer.encode(text, add_special_tokens=False) for text in CLOSERS)
        # what a closing constraint keeps, the first it allows: EOS, then CLOSERS
        self.closing_ids = self.eos_ids + [ids[0] for ids in single if len(ids) == 1]

    def json_schema(self, schema: dict, max_tokens: int) -> "Constraint":
        """Output that is one JSON value valid under `schema`."""
        if not isinstance(schema, dict):
            raise InvalidRequestError("a JSON schema must be an object")
        return self._constraint(llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}), max_tokens)

    def json_object(self, max_tokens: int) -> "Constraint":
        """Output that is one JSON object (any keys)."""
        return self.json_schema({"type": "object"}, max_tokens)

    def tool_call(self, tools: list[dict], max_tokens: int) -> "Constraint":
        """Output that is one Hermes-format call (`<tool_call>` JSON `</tool_call>`) of
        one of `tools` (OpenAI function specs: name, parameters), its arguments valid
        under that tool's parameters schema."""
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["name"]},
                                 "arguments": t.get("parameters") or {"type": "object"}}}
                 for t in tools]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        opening, closing = json.dumps(OPEN + "\n"), json.dumps("\n" + CLOSE)
        lark = f"start: {opening} call {closing}\ncall: %json {json.dumps(schema)}\n"
        return self._constraint(llguidance.LLMatcher.grammar_from_lark(lark), max_tokens)

    def _constraint(self, grammar: str, max_tokens: int) -> "Constraint":
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the output grammar does not compile: "
                                      f"{matcher.get_error()}")
        return Constraint(self, matcher, max_tokens)


class Constraint:
    """One request's grammar state; a `logits_processor` (token ids so far -> bias)."""

    def __init__(self, grammars: Grammars, matcher, max_tokens: int):
        self._grammars, self._matcher = grammars, matcher
        self._reserve = min(MAX_RESERVE, max_tokens // 2)
        self.max_tokens = max_tokens
        self._fed: list[int] = []
        self._bits = llnp.allocate_token_bitmask(1, grammars.vocab_size)
        self.mask_seconds = 0.0  # time spent computing masks (the per-token cost)
        self.masks = 0

    def __call__(self, generated: list[int]) -> np.ndarray:
        self._feed(generated)
        allowed = self.allowed()
        bias = np.full(self._grammars.vocab_size, -np.inf, np.float32)
        if self._closing(generated):
            first = next((t for t in self._grammars.closing_ids if allowed[t]), None)
            if first is not None:
                bias[first] = 0.0
                return bias
        bias[allowed] = 0.0
        return bias

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as booleans [vocab]."""
        start = time.perf_counter()
        llnp.fill_next_token_bitmask(self._matcher, self._bits, 0)
        bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")
        self.mask_seconds += time.perf_counter() - start
        self.masks += 1
        return bits[:self._grammars.vocab_size].astype(bool)

    def _feed(self, generated: list[int]) -> None:
        """Bring the matcher to `generated` (rolling back what differs: the engine may
        ask again for ids it asked about before)."""
        same = len(self._fed)
        if generated[:same] != self._fed:  # the usual case, ids extended, costs one compare
            same = shared_prefix(self._fed, generated)
        if same < len(self._fed):
            self._matcher.rollback(len(self._fed) - same)
            del self._fed[same:]
        for t in generated[same:]:
            if not self._matcher.consume_token(t):
                raise ValueError(f"token {t} breaks the output grammar: "
                                 f"{self._matcher.get_error()}")
            self._fed.append(t)

    def _closing(self, generated: list[int]) -> bool:
        if len(generated) >= self.max_tokens - self._reserve:
            return True
        tail = generated[-LOOP_TOKENS:]
        return len(tail) == LOOP_TOKENS and len(set(tail)) == 1


def tool_choice_constraint(grammars: Grammars, tools: list[dict], choice,
                           max_tokens: int) -> Constraint | None:
    """The constraint of a chat request's `tool_choice` (None for "auto", "none" or
    none given): "required" holds the output to one call of any of `tools` (OpenAI tool
    objects), {"type": "function", "function": {"name": N}} to one call of N."""
    if choice in (None, "auto", "none"):
        return None
    specs = [t["function"] for t in tools or []]
    if not specs:
        raise InvalidRequestError(f"tool_choice {json.dumps(choice)} needs tools; send "
                                  "the functions the model may call in `tools`")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        specs = [f for f in specs if f["name"] == name]
        if not specs:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which "
                                      "is not among the request's tools")
    return grammars.tool_call(specs, max_tokens)


def response_format_constraint(grammars: Grammars, response_format: dict | None,
                               max_tokens: int) -> Constraint | None:
    """The constraint of a chat request's `response_format` (None for "text" or none)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return grammars.json_object(max_tokens)
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if schema is None:
            raise InvalidRequestError('response_format of type "json_schema" needs '
                                      '"json_schema": {"name": ..., "schema": {...}}')
        return grammars.json_schema(schema, max_tokens)
    return None
