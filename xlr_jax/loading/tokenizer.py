"""Text <-> token ids, and chat templates, for a GGUF file or an HF tokenizer directory.

The runtime must not depend on transformers, so this rebuilds with `tokenizers` the same pipeline that
transformers builds from a GGUF's metadata, and renders chat templates in the same jinja environment.
"""

import copy
import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from xlr_jax.errors import TokenizerError

# llama.cpp's `tokenizer.ggml.token_type` values for special tokens.
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values whose merges were learned on a split other than GPT-2's, as transformers maps them.
# Any other value (default, gpt2, smollm, ...) keeps ByteLevel's own GPT-2 split, as transformers does.
_PRE_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level vocabularies are written."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value) -> str | None:
    # tokenizer_config.json writes a special token either as a string or as a serialized AddedToken.
    return value.get("content") if isinstance(value, dict) else value


def _raise_exception(message):
    raise TokenizerError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Replaces jinja's own filter, which escapes HTML characters; transformers does the same.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)  # templates are compiled once, not per request
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers` pipeline plus the special-token facts and chat template a model ships with."""

    def __init__(self, backend: _Backend, *, bos_token_id: int | None, bos_token: str | None,
                 eos_token: str | None, eos_token_ids, add_bos_token: bool, chat_template: str | None,
                 vocab_size: int):
        self._backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.bos_token = bos_token  # bos/eos text, for chat templates
        self.eos_token = eos_token
        self.eos_token_ids = frozenset(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """Build from a GGUF file's tokenizer metadata (`loading.gguf_file`; byte-level BPE
        vocabularies only)."""
        meta = reader.fields.get

        kind = meta("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer type {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "load the tokenizer from an HF directory that has a tokenizer.json instead"
            )
        tokens, merges = meta("tokenizer.ggml.tokens"), meta("tokenizer.ggml.merges")
        if not tokens or not merges:
            raise TokenizerError("the GGUF has no tokenizer.ggml.tokens or merges; use an HF tokenizer directory")
        types = meta("tokenizer.ggml.token_type", [])

        # Some files store tokens as plain text rather than in the byte alphabet; respell those as transformers does.
        spelling = _byte_spelling()
        alphabet = set(spelling.values())
        vocab = {
            t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)
        }
        backend = _Backend(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
        split = _PRE_SPLITS.get(meta("tokenizer.ggml.pre"))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        backend.decoder = decoders.ByteLevel()
        # Control and user-defined tokens must match whole in the text instead of being cut into pieces. A "control"
        # token spelled outside the byte alphabet is a llama.cpp mislabel, skipped as transformers skips it.
        backend.add_special_tokens([
            AddedToken(t, normalized=False, special=True)
            for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet
        ])
        backend.add_tokens([
            AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab
        ])

        bos_id, eos_id = meta("tokenizer.ggml.bos_token_id"), meta("tokenizer.ggml.eos_token_id")
        # llama.cpp also ends generation on the declared end-of-turn and end-of-message tokens.
        eos_ids = {eos_id, meta("tokenizer.ggml.eot_token_id"), meta("tokenizer.ggml.eom_token_id")} - {None}
        return cls(
            backend,
            bos_token_id=bos_id,
            bos_token=tokens[bos_id] if bos_id is not None else None,
            eos_token=tokens[eos_id] if eos_id is not None else None,
            eos_token_ids=eos_ids,
            add_bos_token=bool(meta("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta("tokenizer.chat_template"),
            vocab_size=len(tokens),
        )

    @classmethod
    def from_hf_dir(cls, path) -> "Tokenizer":
        """Build from an HF model directory: tokenizer.json, tokenizer_config.json and friends."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{path} has no tokenizer.json; point at an HF model directory that has one")
        backend = _Backend.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special = {**_read_json(path / "special_tokens_map.json"), **config}
        bos_token, eos_token = _token_text(special.get("bos_token")), _token_text(special.get("eos_token"))

        bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        eos_ids = {backend.token_to_id(eos_token)} if eos_token is not None else set()
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids.update([generation_eos] if isinstance(generation_eos, int) else generation_eos or [])
        eos_ids.discard(None)

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # Without the flag, the tokenizer.json post-processor decides (as for Llama 3); see whether it adds BOS.
            add_bos = bos_id is not None and backend.encode("").ids[:1] == [bos_id]

        template_file = path / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # older format: named templates; the runtime uses the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        return cls(
            backend,
            bos_token_id=bos_id,
            bos_token=bos_token,
            eos_token=eos_token,
            eos_token_ids=eos_ids,
            add_bos_token=bool(add_bos),
            chat_template=template,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
        )

    def save(self, directory) -> None:
        """Write what `load` rebuilds this exact tokenizer from (e.g. one built from a GGUF,
        whose metadata takes seconds to parse)."""
        directory = Path(directory)
        (directory / "tokenizer.json").write_text(self.backend_json(), encoding="utf-8")
        facts = {"bos_token_id": self.bos_token_id, "bos_token": self.bos_token,
                 "eos_token": self.eos_token, "eos_token_ids": sorted(self.eos_token_ids),
                 "add_bos_token": self.add_bos_token, "chat_template": self.chat_template,
                 "vocab_size": self.vocab_size}
        (directory / "tokenizer_facts.json").write_text(json.dumps(facts), encoding="utf-8")

    @classmethod
    def load(cls, directory) -> "Tokenizer":
        """The tokenizer `save` wrote to `directory`."""
        directory = Path(directory)
        facts = json.loads((directory / "tokenizer_facts.json").read_text(encoding="utf-8"))
        return cls(_Backend.from_file(str(directory / "tokenizer.json")), **facts)

    def backend_json(self) -> str:
        """The `tokenizers` pipeline as tokenizer.json text (what grammar libraries read)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The post-processor is bypassed so that BOS follows `add_bos_token` alone, whatever the source.
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, **extra) -> str:
        if self.chat_template is None:
            raise TokenizerError("the model has no chat template; send a raw prompt (completions) instead of messages")
        # Like transformers: keys set to None (OpenAI's content=None) count as absent.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, "documents": None, **extra}
        try:
            return _compile_template(self.chat_template).render(
                **variables, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt
            )
        except TokenizerError:
            raise
        except Exception as e:
            raise TokenizerError(f"the chat template failed: {e}") from e

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Turns generated ids into text pieces as they arrive, holding back incomplete UTF-8 characters.

    Each push decodes only a short window that starts at a character boundary already emitted, and returns what it
    adds beyond the text already emitted from that window. Decoding a window rather than each token alone keeps
    multi-byte characters and context-dependent decoders (e.g. a leading-space strip) right.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._start = 0  # the window starts here, at a boundary of emitted text
        self._done = 0  # ids[start:done] are fully emitted

    def _advance(self, hold_incomplete: bool) -> str:
        emitted = self._tokenizer.decode(self._ids[self._start:self._done], self._skip)
        text = self._tokenizer.decode(self._ids[self._start:], self._skip)
        # U+FFFD at the end means the last character's bytes are not all here yet.
        if len(text) <= len(emitted) or (hold_incomplete and text.endswith("\ufffd")):
            return ""
        self._start, self._done = self._done, len(self._ids)
        return text[len(emitted):]

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(hold_incomplete=True)

    def fork(self) -> "IncrementalDecoder":
        """An independent decoder at the same point (an SMC particle's copy)."""
        twin = copy.copy(self)
        twin._ids = list(self._ids)
        return twin

    def flush(self) -> str:
        """The text still held back at the end of generation (an incomplete character, as U+FFFD)."""
        return self._advance(hold_incomplete=False)
