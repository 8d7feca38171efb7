"""A tiny but complete llama GGUF (random f32 weights, a byte-level BPE tokenizer and a
ChatML template): the whole load path in a second instead of the embedded model's ~10 s."""
from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_gguf(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2, ffn: int = 128,
                    context: int = 2048) -> Path:
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += ["".join(m.split(" ")) for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    head_dim = hidden // heads
    writer.add_tensor("token_embd.weight", w(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_q.weight", w(heads * head_dim, hidden))
        writer.add_tensor(b + "attn_k.weight", w(kv_heads * head_dim, hidden))
        writer.add_tensor(b + "attn_v.weight", w(kv_heads * head_dim, hidden))
        writer.add_tensor(b + "attn_output.weight", w(hidden, heads * head_dim))
        writer.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(b + "ffn_gate.weight", w(ffn, hidden))
        writer.add_tensor(b + "ffn_up.weight", w(ffn, hidden))
        writer.add_tensor(b + "ffn_down.weight", w(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
