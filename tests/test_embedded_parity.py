"""The embedded SmolLM2 against transformers on the same GGUF weights (f32)."""
import numpy as np
import pytest
import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village at the edge of a vast forest, there lived an old "
    "clockmaker who",
    "Les trois mousquetaires sont",
]
CHATS = [
    [{"role": "user", "content": "What is the tallest mountain in the world?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
]


def hf_greedy(hf_model, ids, n, stop_at_eos=True):
    """transformers' greedy tokens, by hand so that EOS can be passed through."""
    out, past, feed = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            step = hf_model(feed, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            if stop_at_eos and out[-1] == 2:
                break
            feed = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(model, hf_model, prompt):
    ids = model.tokenizer.encode(prompt)
    ours = model.logits(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-3, f"relative logit error {rel:.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_64_greedy_tokens_match_transformers(model, hf_model, prompt):
    ids = model.tokenizer.encode(prompt)
    ref = hf_greedy(hf_model, ids, 64, stop_at_eos=False)
    got = model.generate(prompt, max_tokens=64, ignore_eos=True).token_ids
    assert got == ref


@pytest.mark.parametrize("messages", CHATS)
def test_chat_greedy_tokens_match_transformers(model, hf_model, messages):
    text = model.chat_prompt(messages)
    ids = model.tokenizer.encode(text)
    ref = hf_greedy(hf_model, ids, 64)
    result = model.chat(messages, max_tokens=64)
    assert result.token_ids == ref
    assert result.finish_reason == ("stop" if ref[-1] == 2 else "length")
    assert result.text == model.tokenizer.decode(ref, skip_special_tokens=True)


def test_batched_prompts_equal_each_alone(model):
    alone = [model.generate(p, max_tokens=24).token_ids for p in PROMPTS]
    batched = model.generate(PROMPTS, max_tokens=24)
    assert [r.token_ids for r in batched] == alone


def test_more_prompts_than_max_batch_all_complete(model):
    prompts = [f"Count to {i}:" for i in range(model.engine.scheduler.max_batch + 3)]
    alone = [model.generate(p, max_tokens=6).token_ids for p in prompts[-2:]]
    results = model.generate(prompts, max_tokens=6)
    assert len(results) == len(prompts) and all(len(r.token_ids) == 6 for r in results)
    assert [r.token_ids for r in results[-2:]] == alone
    assert model.engine.kv.pool.num_available == model.engine.kv.pool.num_pages - 1  # nothing leaked
