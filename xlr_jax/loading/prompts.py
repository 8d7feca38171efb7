"""Prompts to token ids and tier boundaries: the one function the API and the server call.

A prompt is a string, token ids, a tiered dict {"stable", "context", "volatile"} or chat
messages. Its ids come with (stable end, context end): [0, stable) is the stable tier
(a system prompt and tools, pinned in the prefix cache), [stable, context) the context
(earlier turns), the rest volatile. A chat's tiers are where the rendering of its system
messages, then of every message but the last, stops agreeing with the whole rendering
(`rendered_end`): a template may render a message differently when more follow, so the
common prefix is the boundary, not the message lengths.
"""
from __future__ import annotations

import os

import numpy as np

from xlr_jax.errors import InvalidRequestError, PromptTooLongError
from xlr_jax.kv.prefix_cache import TIERS
from xlr_jax.loading.tokenizer import Tokenizer


def shared_prefix(a, b) -> int:
    """How many leading tokens two id lists share."""
    return len(os.path.commonprefix([a, b]))


def check_prompt(ids: list[int], max_context: int) -> list[int]:
    """`ids` if they make a prompt the context holds, with room for one new token."""
    if not ids:
        raise InvalidRequestError("the prompt is empty; pass at least one token of text")
    if len(ids) >= max_context:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens but the context holds {max_context}; "
            "shorten the prompt or load the model with a larger max_context")
    return ids


class PromptEncoder:
    """A model's prompts to (token ids, tiers), checked against its vocabulary and context."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_context: int):
        self.tokenizer, self.vocab_size, self.max_context = tokenizer, vocab_size, max_context

    def ids(self, prompt, bos: bool = True) -> list[int]:
        """A prompt's token ids: a string through the tokenizer (`bos`: with its special
        tokens; then checked as a whole prompt), or ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer (no tokenizer.json); "
                                          "pass a list of token ids as the prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=bos)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer))
                                                       for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                          f"[0, {self.vocab_size})")
        else:
            raise InvalidRequestError("a prompt is a string or a list of token ids; "
                                      f"got {type(prompt).__name__}")
        return check_prompt(ids, self.max_context) if bos else ids

    def encode(self, prompt_or_messages, tools: list | None = None
               ) -> tuple[list[int], tuple[int, int]]:
        """A prompt's or a conversation's ids and (stable end, context end)."""
        p = prompt_or_messages
        if isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) for m in p):
            return self.encode_chat(list(p), tools)
        if not isinstance(p, dict):
            return self.ids(p), (0, 0)
        unknown = set(p) - set(TIERS)
        if unknown:
            raise InvalidRequestError(f"unknown prompt tier(s) {sorted(unknown)}; a tiered "
                                      f"prompt has the keys {', '.join(TIERS)}")
        ids, ends = [], []
        for tier in TIERS:
            part = p.get(tier)
            if part:  # each tier tokenized alone: its boundary is exact (BOS only first)
                ids += self.ids(part, bos=not ids)
            ends.append(len(ids))
        check_prompt(ids, self.max_context)
        return ids, (ends[0], ends[1])

    def chat_prompt(self, messages, tools: list | None = None) -> str:
        """The conversation rendered by the chat template, ready for the assistant's turn."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer (no tokenizer.json); "
                                      "pass token ids to generate() instead of messages")
        if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidRequestError('messages must be a non-empty list of {"role": ..., '
                                      '"content": ...} dicts')
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tools=tools)

    def encode_chat(self, messages, tools: list | None = None
                    ) -> tuple[list[int], tuple[int, int]]:
        """A conversation's ids and tiers: system messages (and tools) are stable, earlier
        turns context, the last message volatile."""
        ids = self.ids(self.chat_prompt(messages, tools))
        lead = 0
        while lead < len(messages) and messages[lead].get("role") == "system":
            lead += 1
        ends = [self.rendered_end(messages[:upto], tools, ids) if upto > 0 else 0
                for upto in (lead, len(messages) - 1)]
        return ids, (ends[0], max(ends))

    def rendered_end(self, messages, tools, ids: list[int]) -> int:
        """Where `messages` (the head of a conversation whose rendering is `ids`), rendered
        alone, stops agreeing with `ids`: the end of a tier that ends after them."""
        head = self.tokenizer.encode(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, tools=tools))
        return shared_prefix(head, ids)
