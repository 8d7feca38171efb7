"""A tiny but complete llama GGUF (random f32 weights, a byte-level BPE tokenizer and a
ChatML template): the whole load path in a second instead of the embedded model's ~10 s.
And a GGUF of a tiny HF checkpoint's own weights, for the families' GGUF layouts."""
from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


TOKENS = (sorted(pre_tokenizers.ByteLevel.alphabet())
          + ["".join(m.split(" ")) for m in MERGES] + SPECIALS)


def _header(writer, *, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
            context: int, head_dim: int | None = None, eps: float = 1e-5,
            theta: float = 10000.0) -> None:
    """The model's shape and the tiny byte-level BPE tokenizer (`TOKENS`)."""
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_freq_base(theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_merges(MERGES)
    writer.add_token_types([1] * (len(TOKENS) - len(SPECIALS)) + [3] * len(SPECIALS))
    writer.add_bos_token_id(TOKENS.index("<|endoftext|>"))
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


def _finish(writer, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Raw blocks [rows, bytes a row] of llama.cpp type `kind` holding weights of about
    ±0.3: the gguf package's quantizer where it has one (Q4_0, Q4_1, Q8_0), else random
    bytes under random float16 scales small enough (it only reads the K types)."""
    t = gguf.GGMLQuantizationType[kind]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        return gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.2)
                                    .astype(np.float32), t)
    block, size = gguf.GGML_QUANT_SIZES[t]
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    # where a super-block's float16 scales sit, and the largest weight each scale makes
    scales = {"Q4_K": ((0, 15 * 63), (2, 2 * 63)), "Q6_K": ((208, 32 * 128),)}[kind]
    for at, reach in scales:
        d = rng.uniform(0.1, 0.3, (rows, cols // block, 1)) / reach
        b[..., at:at + 2] = d.astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def write_tiny_gguf(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2, ffn: int = 128, context: int = 2048,
                    matrix_type: str = "F32", embedding_type: str = "F32") -> Path:
    """`matrix_type`, `embedding_type`: the llama.cpp type of the layers' matrices and of
    the embedding ("F32", or one `random_blocks` makes)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    _header(writer, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
            context=context)
    rng = np.random.default_rng(seed)

    def add(name, kind, rows, cols):
        if kind == "F32":
            writer.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32))
        else:
            writer.add_tensor(name, random_blocks(kind, rows, cols, rng),
                              raw_dtype=gguf.GGMLQuantizationType[kind])

    head_dim = hidden // heads
    add("token_embd.weight", embedding_type, len(TOKENS), hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_q.weight", matrix_type, heads * head_dim, hidden)
        add(b + "attn_k.weight", matrix_type, kv_heads * head_dim, hidden)
        add(b + "attn_v.weight", matrix_type, kv_heads * head_dim, hidden)
        add(b + "attn_output.weight", matrix_type, hidden, heads * head_dim)
        writer.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        add(b + "ffn_gate.weight", matrix_type, ffn, hidden)
        add(b + "ffn_up.weight", matrix_type, ffn, hidden)
        add(b + "ffn_down.weight", matrix_type, hidden, ffn)
    return _finish(writer, path)


# HF tensor names (after model.layers.{i}.) -> GGUF names (after blk.{i}.), as llama.cpp's
# converter writes a Qwen model (no Q/K row permutation); experts are stacked
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
              "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp",
              "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
EXPERT_TO_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                  "down_proj": "ffn_down_exps", "w1": "ffn_gate_exps", "w3": "ffn_up_exps",
                  "w2": "ffn_down_exps"}


def _permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaving of Q/K rows in "llama" files (pairs of adjacent dims)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_hf_as_gguf(path: Path, arch: str, config: dict, tensors: dict) -> Path:
    """A GGUF of an HF checkpoint (`config.json` as a dict, `tensors` by HF name, f32) as
    llama.cpp's converter writes it: Qwen (dense or MoE) as it is, Mixtral as "llama"
    with Q/K rows permuted, Gemma with 1 added to its norms' weights; with the tiny
    tokenizer: the model's vocabulary must be len(TOKENS)."""
    assert config["vocab_size"] == len(TOKENS)
    writer = gguf.GGUFWriter(str(path), arch)
    rope = config["rope_parameters"]
    gemma = arch.startswith("gemma")
    _header(writer, layers=config["num_hidden_layers"], hidden=config["hidden_size"],
            heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
            ffn=config["intermediate_size"], context=config["max_position_embeddings"],
            head_dim=config["head_dim"], eps=config["rms_norm_eps"],
            theta=rope.get("full_attention", rope)["rope_theta"])
    if gemma:
        writer.add_sliding_window(config["sliding_window"])
        for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                         ("final_logit_softcapping", writer.add_final_logit_softcapping)):
            if config.get(key):
                add(config[key])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:  # (Mixtral's experts are feed_forward_length)
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_weights_norm(config.get("norm_topk_prob", True))
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(
                config["shared_expert_intermediate_size"])
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, array in tensors.items():
        if gemma and name.endswith("norm.weight"):
            array = array + 1
        if name in top:
            if name != "lm_head.weight" or not config["tie_word_embeddings"]:
                writer.add_tensor(top[name], array)
            continue
        _, _, i, rest = name.split(".", 3)
        part, kind = rest.rsplit(".", 1)
        if ".experts." in part:  # mlp.experts.{e}.gate_proj, block_sparse_moe.experts.{e}.w1
            e, proj = part.split(".")[-2:]
            experts.setdefault(f"blk.{i}.{EXPERT_TO_GGUF[proj]}.{kind}", {})[int(e)] = array
            continue
        if part == "mlp.shared_expert_gate":  # llama.cpp keeps it as a vector
            array = array.reshape(-1)
        if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads" if part == "self_attn.q_proj"
                           else "num_key_value_heads"]
            array = _permute_rows(array, heads)
        names = {**HF_TO_GGUF, **GEMMA_NORMS} if gemma else HF_TO_GGUF
        writer.add_tensor(f"blk.{i}.{names[part]}.{kind}", array)
    for name, by_expert in experts.items():
        writer.add_tensor(name, np.stack([by_expert[e] for e in sorted(by_expert)]))
    return _finish(writer, path)
