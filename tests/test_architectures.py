"""The HF loader + decoder against transformers, and paged-KV properties, on tiny random models.

transformers builds each model from a config with random weights and saves it as safetensors; xlr_jax
loads that directory and must reproduce transformers' logits at every position. Weights use a large
init scale (0.2) and random norm weights/biases, so attention is sharp and each feature under test
(rope scaling, sliding window, biases, ...) moves the logits far beyond the tolerance: every case
also checks that switching its feature off breaks the match.
"""
import dataclasses
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as tok_models
from tokenizers import pre_tokenizers
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                          Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM,
                          MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

import xlr_jax
from xlr_jax.errors import UnsupportedModelError
from xlr_jax.kv.paged_kv import PagedKV
from xlr_jax.kv.pages import SCRATCH_PAGE
from xlr_jax.loading.weights import hf_config, load_weights
from xlr_jax.model.config import RopeScaling
from xlr_jax.model.decoder import params_from_arrays
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.model.steps import Steps
from xlr_jax.planning.buckets import REDUCE_ROWS, Buckets
from xlr_jax.planning.hardware import probe
from xlr_jax.planning.mapper import Workload, plan
from xlr_jax.runtime.engine import Engine
from xlr_jax.speculative.config import SpecConfig, resolve_draft

# Relative error max|xlr - hf| / max|hf|. Both sides run in float32 and differ only in summation
# order (observed ~2e-6); a wrong feature gives errors of order 1 (see each case's ablation).
TOL = 1e-4
# An ablated model (feature switched off) must be at least this far off.
BROKEN = 100 * TOL

VOCAB = 256
PAGE = 16
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=512,
            rms_norm_eps=1e-6, initializer_range=0.2, attn_implementation="eager")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 500000.0}


def _no_rope_scaling(config, params):
    return dataclasses.replace(config, rope_scaling=RopeScaling()), params


def _no_bias(config, params):
    layers = {k: v for k, v in params["layers"].items() if k != "bqkv"}
    return dataclasses.replace(config, qkv_bias=False), {**params, "layers": layers}


def _no_qk_norm(config, params):
    layers = {k: v for k, v in params["layers"].items() if k not in ("q_norm", "k_norm")}
    return dataclasses.replace(config, qk_norm=False), {**params, "layers": layers}


def _renorm(on: bool):
    return lambda config, params: (dataclasses.replace(config, norm_topk_prob=on), params)


def _no_shared_gate(config, params):
    layers = {k: v for k, v in params["layers"].items() if k != "w_shared_gate"}
    return dataclasses.replace(config, shared_expert_gate=False), {**params, "layers": layers}


def _window(size):
    return lambda config, params: (dataclasses.replace(config, sliding_window=size), params)


def _no_attn_softcap(config, params):
    return dataclasses.replace(config, attn_softcap=None), params


def _global_rope_everywhere(config, params):
    return dataclasses.replace(config, rope_local_theta=None), params


# Gemma: windows of 24 over 90-token prompts, a query scale of its own (24 ** -0.5 for
# 16-dim heads), caps small enough to bite on these random weights (Gemma-2), and
# Gemma-3's local RoPE base far from its global one
GEMMA = dict(TINY, sliding_window=24, query_pre_attn_scalar=24,
             max_position_embeddings=512)
GEMMA2 = Gemma2Config(num_hidden_layers=4, attn_logit_softcapping=3.0,
                      final_logit_softcapping=5.0, **GEMMA)
GEMMA3 = Gemma3TextConfig(num_hidden_layers=4, sliding_window_pattern=2, rope_parameters={
    "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
    **GEMMA)


# name: (model class, config, prompt length, expected ModelConfig fields, ablation that must break it)
CASES = {
    "llama3_rope_untied": (
        LlamaForCausalLM,
        LlamaConfig(num_hidden_layers=2, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False,
                    **TINY),
        150,  # positions well past original_max_position_embeddings=64
        dict(architecture="llama", tie_embeddings=False, rope_theta=500000.0,
             rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
        _no_rope_scaling),
    "llama_tied": (
        LlamaForCausalLM,
        LlamaConfig(num_hidden_layers=3, tie_word_embeddings=True, **TINY),
        90,
        dict(architecture="llama", tie_embeddings=True, num_layers=3, rope_theta=10000.0,
             rope_scaling=RopeScaling()),
        None),  # the tie is checked on the checkpoint: it has no lm_head.weight
    "qwen2_bias": (
        Qwen2ForCausalLM,
        Qwen2Config(num_hidden_layers=2, tie_word_embeddings=False, **TINY),
        90,
        dict(architecture="qwen2", qkv_bias=True, sliding_window=None),
        _no_bias),
    "mistral_window32": (
        MistralForCausalLM,
        MistralConfig(num_hidden_layers=2, sliding_window=32, **TINY),
        100,  # prompt longer than the window
        dict(architecture="mistral", sliding_window=32),
        _window(None)),
    "qwen3_qk_norm": (
        Qwen3ForCausalLM,  # a head_dim of its own: 4 heads of 24 over a hidden size of 64
        Qwen3Config(num_hidden_layers=2, tie_word_embeddings=True, **{**TINY, "head_dim": 24}),
        90,
        dict(architecture="qwen3", qk_norm=True, qkv_bias=False, head_dim=24,
             sliding_window=None),
        _no_qk_norm),
    # 8 experts, 2 per token: over the prompt every expert is used; a decode step's token
    # leaves 6 without one
    "mixtral_moe": (
        MixtralForCausalLM,
        MixtralConfig(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                      **{**TINY, "intermediate_size": 32}),
        90,
        dict(architecture="mixtral", num_experts=8, experts_per_token=2,
             moe_intermediate_size=32, norm_topk_prob=True, shared_experts=0),
        _renorm(False)),
    "qwen2_moe_shared": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, **TINY),
        90,
        dict(architecture="qwen2_moe", qkv_bias=True, num_experts=8, norm_topk_prob=False,
             shared_intermediate_size=48, shared_expert_gate=True),
        _no_shared_gate),
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, norm_topk_prob=True,
                       **{**TINY, "head_dim": 24}),
        90,
        dict(architecture="qwen3_moe", qk_norm=True, num_experts=8, norm_topk_prob=True,
             shared_experts=0),
        _renorm(False)),
    "gemma2_window": (
        Gemma2ForCausalLM, GEMMA2, 90,
        dict(architecture="gemma2", sliding_window=24, window_layers=(0, 2),
             hidden_act="gelu_tanh", query_pre_attn_scalar=24.0, attn_softcap=3.0,
             final_softcap=5.0, post_norms=True, scale_embeddings=True),
        _no_attn_softcap),
    "gemma3_window": (
        Gemma3ForCausalLM, GEMMA3, 90,
        dict(architecture="gemma3_text", sliding_window=24, window_layers=(0, 2),
             qk_norm=True, rope_local_theta=10.0, rope_theta=1000000.0,
             rope_scaling=RopeScaling("linear", 4.0), attn_softcap=None,
             final_softcap=None),
        _global_rope_everywhere),
    "mistral_no_window": (
        MistralForCausalLM,
        MistralConfig(num_hidden_layers=2, sliding_window=None, **TINY),
        100,
        dict(architecture="mistral", sliding_window=None),
        _window(32)),
}


def rel_err(out, ref) -> float:
    return float(np.abs(np.asarray(out) - ref).max() / np.abs(ref).max())


def random_ids(seed, n):
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(ids)[None])).logits[0].numpy()


def xlr_logits(config, arrays, ids) -> np.ndarray:
    """Logits at every position through Engine.logits (what Model.logits runs).

    The engine gets no tokenizer: these directories have none, and the logits path reads token ids.
    """
    p = plan(probe(), config, Workload(max_batch=1, prefill_chunk=256,
                                       max_context=config.max_context),
             page_size=PAGE, num_pages=40, attn_impl="xla", linear_impl="xla")
    engine = Engine(config, params_from_arrays(arrays), None, p)
    return engine.logits([int(t) for t in ids])


def random_model(cls, config, seed: int):
    """A transformers model with seeded random weights, its norms and biases too (init
    leaves norms at 1 and biases at 0: they must matter)."""
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """name -> (transformers model, directory it was saved to); all weights random, seeded."""
    root = tmp_path_factory.mktemp("hf_models")
    out = {}
    for seed, (name, (cls, config, *_)) in enumerate(CASES.items()):
        model = random_model(cls, config, seed)
        model.save_pretrained(root / name, safe_serialization=True)
        out[name] = (model, root / name)
    return out


# ---------------------------------------------------------------- loader + model vs transformers

@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(zoo, name):
    _, _, length, expected, ablate = CASES[name]
    hf, path = zoo[name]
    loaded = load_weights(path, cache_dir=None)
    for field, value in expected.items():
        assert getattr(loaded.config, field) == value, field

    ids = random_ids(100 + len(name), length)
    ref = hf_logits(hf, ids)
    out = xlr_logits(loaded.config, loaded.params, ids)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < TOL
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))

    if ablate is not None:  # the feature is exercised: without it the logits are far off
        assert rel_err(xlr_logits(*ablate(loaded.config, loaded.params), ids), ref) > BROKEN


def _replace(**fields):
    return lambda config, params: (dataclasses.replace(config, **fields), params)


def _without_leaves(*names, **fields):
    def ablate(config, params):
        layers = {k: v for k, v in params["layers"].items() if k not in names}
        return dataclasses.replace(config, **fields), {**params, "layers": layers}
    return ablate


def _norms_as_stored(config, params):  # the checkpoint's w, not Gemma's 1 + w
    layers = {k: v - 1 if "norm" in k else v for k, v in params["layers"].items()}
    return config, {**params, "layers": layers, "final_norm": params["final_norm"] - 1}


GEMMA_ABLATIONS = {
    "final_softcap": ("gemma2_window", _replace(final_softcap=None)),
    "window_everywhere": ("gemma2_window", _replace(window_layers=())),
    "no_window": ("gemma3_window", _replace(sliding_window=None, window_layers=())),
    "head_dim_scale": ("gemma2_window", _replace(query_pre_attn_scalar=None)),
    "no_post_norms": ("gemma2_window", _without_leaves("post_attn_norm", "post_mlp_norm",
                                                       post_norms=False)),
    "unscaled_embeddings": ("gemma3_window", _replace(scale_embeddings=False)),
    "silu": ("gemma3_window", _replace(hidden_act="silu")),
    "norm_offset": ("gemma3_window", _norms_as_stored),
    "no_qk_norm": ("gemma3_window", _no_qk_norm),
}


@pytest.mark.parametrize("ablation", GEMMA_ABLATIONS)
def test_every_gemma_feature_is_needed(zoo, ablation):
    """Each of Gemma's differences from the base decoder, switched off alone, moves the
    logits far from transformers' (the matching case passes in test_logits_match)."""
    name, ablate = GEMMA_ABLATIONS[ablation]
    hf, path = zoo[name]
    loaded = load_weights(path, cache_dir=None)
    ids = random_ids(100 + len(name), CASES[name][2])
    assert rel_err(xlr_logits(*ablate(loaded.config, loaded.params), ids),
                   hf_logits(hf, ids)) > BROKEN


@pytest.mark.parametrize("name", ["qwen3_qk_norm", "mixtral_moe", "qwen3_moe",
                                  "gemma2_window", "gemma3_window"])
def test_greedy_tokens_match_transformers(zoo, name):
    """32 greedy tokens through the engine's loop (the prompt prefilled in chunks, then
    decode steps), plain and by exact self-speculation (its first layer drafting), are
    transformers' greedy tokens (its full forward at each length)."""
    hf, path = zoo[name]
    loaded = load_weights(path, cache_dir=None)
    prompt = [int(t) for t in random_ids(7, 40)]
    ids = list(prompt)
    for _ in range(32):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    config = loaded.config
    p = plan(probe(), config, Workload(max_batch=1, prefill_chunk=16,
                                       max_context=config.max_context),
             page_size=PAGE, num_pages=40, attn_impl="xla", linear_impl="xla")
    engine = Engine(config, params_from_arrays(loaded.params), None, p)
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    for spec in (None, SpecConfig(method="exact", draft="self:1", gamma=3)):
        events = list(engine.run([prompt], [greedy], spec=spec,
                                 draft=spec and resolve_draft(spec.draft, config)))
        result = events[-1][2]
        assert result.token_ids == ids[len(prompt):], spec
        if spec is not None:  # drafts were proposed and verified (not a plain decode)
            assert result.metrics["draft_tokens"] > 0 and result.metrics["target_passes"] < 31


GGUF_CASES = {  # a GGUF's general.architecture: (its transformers model, config)
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=24)),
    "qwen3moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig,
                 dict(head_dim=24, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen2moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig,
                 dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48)),
    "llama": (MixtralForCausalLM, MixtralConfig,  # llama.cpp writes Mixtral as "llama"
              dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                   intermediate_size=32)),
    # llama.cpp's GGUFs do not say the query scale (head_dim's but for the 27B models),
    # Gemma-3's window pattern (6) or local RoPE base (10,000): the HF side uses those
    "gemma2": (Gemma2ForCausalLM, Gemma2Config,
               dict(GEMMA2.to_dict(), num_hidden_layers=3, query_pre_attn_scalar=16,
                    layer_types=None)),
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig,
               dict(GEMMA3.to_dict(), num_hidden_layers=7, query_pre_attn_scalar=16,
                    layer_types=None, sliding_window_pattern=6, rope_parameters={
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
}


@pytest.mark.parametrize("arch", GGUF_CASES)
def test_a_gguf_of_the_same_weights_loads_the_same(tmp_path, arch):
    """A GGUF written from an HF checkpoint (llama.cpp's tensor names and keys, experts
    stacked): the same config and params as from safetensors, and transformers' logits."""
    from tiny_gguf import TOKENS, write_hf_as_gguf

    cls, config_cls, options = GGUF_CASES[arch]
    config = config_cls(**{"num_hidden_layers": 2, **TINY, **options,
                           "tie_word_embeddings": False, "vocab_size": len(TOKENS)})
    hf = random_model(cls, config, seed=11)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="numpy") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    gguf_file = write_hf_as_gguf(tmp_path / f"{arch}.gguf", arch, raw, tensors)
    from_gguf = load_weights(gguf_file, cache_dir=None)
    from_hf = load_weights(tmp_path / "hf", cache_dir=None)
    eps = from_gguf.config.rms_norm_eps  # a GGUF keeps it in float32
    assert eps == pytest.approx(from_hf.config.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=from_hf.config.rms_norm_eps) \
        == from_hf.config
    leaves = [jax.tree_util.tree_leaves_with_path(x.params) for x in (from_gguf, from_hf)]
    assert [p for p, _ in leaves[0]] == [p for p, _ in leaves[1]]
    for (p, x), (_, y) in zip(*leaves):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(p))
    ids = random_ids(3, 60)
    assert rel_err(xlr_logits(from_gguf.config, from_gguf.params, ids),
                   hf_logits(hf, ids)) < TOL


def test_fused_experts_load_as_per_expert_ones(zoo, tmp_path):
    """The fused expert layout transformers v5 writes (experts.gate_up_proj [E, 2I, d],
    experts.down_proj [E, d, I]) loads the same params as one tensor per expert."""
    from safetensors.numpy import save_file

    _, path = zoo["qwen3_moe"]
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in range(2):
        e = f"model.layers.{i}.mlp.experts."
        stack = lambda n: np.stack([tensors[f"{e}{j}.{n}.weight"] for j in range(8)])  # noqa: E731
        fused[e + "gate_up_proj"] = np.concatenate([stack("gate_proj"), stack("up_proj")], 1)
        fused[e + "down_proj"] = stack("down_proj")
    save_file(fused, str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    a, b = load_weights(path, cache_dir=None), load_weights(tmp_path, cache_dir=None)
    assert jax.tree_util.tree_structure(a.params) == jax.tree_util.tree_structure(b.params)
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("change, error", [
    (lambda raw: raw.update(model_type="gemma4"), "model_type 'gemma4' is not supported"),
    (lambda raw: raw.update(mlp_only_layers=[0]), "mlp_only_layers"),
    (lambda raw: raw.update(decoder_sparse_step=2), "decoder_sparse_step"),
])
def test_a_config_the_loader_does_not_understand_is_refused_by_name(change, error):
    raw = Qwen3MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, **TINY).to_dict()
    change(raw)
    with pytest.raises(UnsupportedModelError, match=error):
        hf_config(raw)


def test_a_tensor_no_family_reads_is_refused_by_name(zoo, tmp_path):
    """A checkpoint with a tensor its family does not read (here a norm Llama has not) is
    refused, not run without it."""
    from safetensors.numpy import save_file

    _, path = zoo["llama_tied"]
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    tensors["model.layers.1.post_feedforward_layernorm.weight"] = np.ones(64, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(UnsupportedModelError,
                       match="model.layers.1.post_feedforward_layernorm.weight"):
        load_weights(tmp_path, cache_dir=None)


def test_tied_checkpoint_has_no_lm_head(zoo):
    """The tied case really takes the tied path: there is no lm_head tensor to fall back on."""
    _, path = zoo["llama_tied"]
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        assert "lm_head.weight" not in set(f.keys())
    assert "lm_head" not in load_weights(path, cache_dir=None).params


def test_qwen2_biases_loaded(zoo):
    hf, path = zoo["qwen2_bias"]
    attn = hf.model.layers[1].self_attn
    expected = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach().numpy()
    bqkv = load_weights(path, cache_dir=None).params["layers"]["bqkv"]
    assert np.abs(expected).min() > 0
    np.testing.assert_array_equal(bqkv[1], expected)


def test_transformers4_rope_config_reads_the_same(zoo):
    """transformers 5 saves `rope_parameters` (theta inside); v4 saved `rope_scaling` + `rope_theta`."""
    _, path = zoo["llama3_rope_untied"]
    v5 = json.loads((path / "config.json").read_text())
    assert v5["rope_parameters"]["rope_type"] == "llama3" and "rope_scaling" not in v5
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_scaling"] = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    v4["rope_theta"] = LLAMA3_ROPE["rope_theta"]
    assert hf_config(v4) == hf_config(v5)
    assert hf_config(v5).rope_scaling.kind == "llama3"


def test_sharded_checkpoint_loads_identically(zoo, tmp_path):
    hf, single = zoo["qwen2_bias"]
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((tmp_path / s).exists() for s in shards)

    a, b = load_weights(single, cache_dir=None), load_weights(tmp_path, cache_dir=None)
    assert a.config == b.config
    leaves_a, leaves_b = (jax.tree_util.tree_leaves_with_path(x.params) for x in (a, b))
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    for (p, x), (_, y) in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(p))


@pytest.mark.parametrize("name", ["llama3_rope_untied", "qwen2_moe_shared", "gemma3_window"])
def test_load_model_public_api(zoo, tmp_path, name):
    """load_model + Model.logits / Model.generate on token ids (a word-level tokenizer is added:
    load_model requires a tokenizer.json); the same prompt again reuses its cached prefix."""
    hf, path = zoo[name]
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    tok = HFTokenizer(tok_models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))

    model = xlr_jax.load_model(str(tmp_path), dtype="float32", params_cache=False, page_size=PAGE)
    ids = [int(t) for t in random_ids(7, 120)]
    ref = hf_logits(hf, ids)
    out = model.logits(ids)
    assert rel_err(out, ref) < TOL

    seq = list(ids)
    for _ in range(8):  # transformers' greedy continuation
        seq.append(int(hf_logits(hf, seq)[-1].argmax()))
    result = model.generate(ids, max_tokens=8, ignore_eos=True)
    assert result.token_ids == seq[len(ids):]
    again = model.generate(ids, max_tokens=8, ignore_eos=True)
    assert again.token_ids == result.token_ids and again.metrics["cached_tokens"] >= 112
    config = model.config
    experts = model.info().get("experts")
    assert experts == ({"total": 8, "active": 2, "shared": 1} if config.num_experts else None)


@pytest.mark.parametrize("name", ["qwen3_moe", "gemma2_window"])
def test_a_draft_model_speculates_for_a_model_of_its_family(zoo, tmp_path, name):
    """Exact speculation on Qwen3-MoE and on Gemma-2 with a separate one-layer draft of
    the same family (the target's first layer, embedding and head, with its own KV): the
    target's greedy tokens, its drafts proposed and verified."""
    hf, path = zoo[name]
    shutil.copytree(path, tmp_path / "target")
    tok = HFTokenizer(tok_models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "target" / "tokenizer.json"))
    raw = {**hf.config.to_dict(), "num_hidden_layers": 1}
    if raw.get("layer_types"):
        raw["layer_types"] = raw["layer_types"][:1]
    draft = type(hf)(type(hf.config)(**raw)).float().eval()
    draft.load_state_dict({k: v for k, v in hf.state_dict().items()
                           if not k.startswith("model.layers.") or k.startswith("model.layers.0.")})
    draft.save_pretrained(tmp_path / "draft", safe_serialization=True)

    model = xlr_jax.load_model(str(tmp_path / "target"), dtype="float32", params_cache=False,
                               page_size=PAGE)
    ids = [int(t) for t in random_ids(9, 40)]
    plain = model.generate(ids, max_tokens=24, ignore_eos=True)
    spec = model.generate(ids, max_tokens=24, ignore_eos=True, speculative={
        "method": "exact", "draft": str(tmp_path / "draft"), "gamma": 3})
    assert spec.token_ids == plain.token_ids
    assert spec.metrics["draft_tokens"] > 0 and spec.metrics["target_passes"] < 24


# ---------------------------------------------------------------- paged-KV properties (via Steps)

NUM_PAGES = 48
WIDTH = 8                  # block-table width: 7 pages hold the 100-token sequence, 1 padding entry
SEQ_LEN = 100
ONE_SHOT_T = 112           # one-shot chunk width (padded past SEQ_LEN)


class Paged:
    """One tiny model on Steps, over a KV pool of random values: a read of a wrong or unwritten
    slot changes the logits. Positions, lengths and block tables are explicit."""

    def __init__(self, path, hf):
        loaded = load_weights(path, cache_dir=None)
        self.config = loaded.config
        self.params = params_from_arrays(loaded.params).per_layer()
        # the CPU plan's products: up to 16 rows as multiply-sums, more as dots
        self.steps = Steps(self.config, Buckets(batch=(1, 2, 4), chunk=(16, 32, 64),
                                                pages=(WIDTH,), attn_block=2,
                                                reduce_rows=REDUCE_ROWS))
        self.hf = hf
        self.ids = random_ids(11, SEQ_LEN)

    def fresh_kv(self, seed=0) -> PagedKV:
        c = self.config
        shape = (c.num_layers, NUM_PAGES, c.num_kv_heads, PAGE, c.head_dim)
        kk, kv = jax.random.split(jax.random.key(seed))
        return PagedKV(k=jax.random.normal(kk, shape), v=jax.random.normal(kv, shape))

    @staticmethod
    def table(pages) -> np.ndarray:
        row = np.full(WIDTH, SCRATCH_PAGE, np.int32)
        row[:len(pages)] = pages
        return row

    @staticmethod
    def padded(rows, width, seed=0) -> np.ndarray:
        """Token rows padded with random ids (padding must be ignored, whatever it holds)."""
        out = np.random.default_rng(seed).integers(0, VOCAB, (len(rows), width)).astype(np.int32)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        return out

    def all_logits(self, kv, rows, starts, tables, width):
        tokens = self.padded(rows, width, seed=len(rows) + width)
        logits, kv = self.steps.all_logits(
            self.params, kv, tokens, np.asarray(starts, np.int32),
            np.array([len(r) for r in rows], np.int32), np.stack(tables))
        return np.asarray(logits), kv

    def one_shot(self, kv):
        """Logits of the whole sequence prefilled at once into pages 1..7, and the KV."""
        logits, kv = self.all_logits(kv, [self.ids], [0], [self.table(range(1, 8))], ONE_SHOT_T)
        return logits[0, :SEQ_LEN], kv


# An untied llama3-rope model, and the sliding-window Mistral (window 32 < the sequence).
@pytest.fixture(scope="module", params=["llama3_rope_untied", "mistral_window32"])
def paged(zoo, request):
    hf, path = zoo[request.param]
    return Paged(path, hf)


@pytest.fixture(scope="module")
def one_shot(paged):
    ref, kv = paged.one_shot(paged.fresh_kv())
    assert rel_err(ref, hf_logits(paged.hf, paged.ids)) < TOL  # anchored to transformers
    return ref, kv


def test_scrambled_block_table(paged, one_shot):
    ref, kv_identity = one_shot
    pages = np.random.default_rng(5).permutation(np.arange(1, NUM_PAGES))[:7]
    assert not np.all(np.diff(pages) == 1)
    logits, kv = paged.all_logits(paged.fresh_kv(seed=1), [paged.ids], [0], [paged.table(pages)],
                                  ONE_SHOT_T)
    assert rel_err(logits[0, :SEQ_LEN], ref) < TOL
    # the KV landed in the scrambled physical pages, in sequence order
    for cache, cache_identity in ((kv.k, kv_identity.k), (kv.v, kv_identity.v)):
        # [layers, pages, kv_heads, page_size, head_dim] -> positions in sequence order
        def positions(pool, ids):
            got = np.asarray(pool)[:, ids].transpose(0, 2, 1, 3, 4)
            return got.reshape(*got.shape[:2], -1, got.shape[-1])[:, :, :SEQ_LEN]
        np.testing.assert_array_equal(positions(cache, pages),
                                      positions(cache_identity, list(range(1, 8))))


def test_chunked_prefill(paged, one_shot):
    ref, _ = one_shot
    table = paged.table(range(1, 8))
    kv, start, out = paged.fresh_kv(seed=2), 0, []
    # (chunk, padded width as the engine buckets it); chunks 2-4 start mid-page (7, 23, 56)
    for size, width in ((7, 16), (16, 16), (33, 64), (44, 64)):
        logits, kv = paged.all_logits(kv, [paged.ids[start:start + size]], [start], [table],
                                      width)
        out.append(logits[0, :size])
        start += size
    assert start == SEQ_LEN
    assert rel_err(np.concatenate(out), ref) < TOL


def test_batched_rows_of_different_lengths(paged):
    rng = np.random.default_rng(6)
    lengths = (100, 5, 64, 0)  # the last row is batch padding, as the engine sends it
    rows = [rng.integers(0, VOCAB, n) for n in lengths]
    free = list(rng.permutation(np.arange(1, NUM_PAGES)))
    tables = [paged.table([free.pop() for _ in range(-(-n // PAGE))]) for n in lengths]
    batched, _ = paged.all_logits(paged.fresh_kv(seed=3), rows, [0] * 4, tables, ONE_SHOT_T)
    for i, n in enumerate(lengths[:3]):
        alone, _ = paged.all_logits(paged.fresh_kv(seed=4), [rows[i]], [0], [tables[i]],
                                    ONE_SHOT_T)
        assert rel_err(alone[0, :n], hf_logits(paged.hf, rows[i])) < TOL, f"row {i} alone"
        assert rel_err(batched[i, :n], alone[0, :n]) < TOL, f"row {i} in the batch"


def test_incremental_decode(paged, one_shot):
    """A prompt's chunk, then one decode row per step, on the ragged step: the logits
    are the one-shot prefill's at every position."""
    ref, _ = one_shot
    table = paged.table(range(1, 8))
    k = 40
    build = paged.steps.builder(0, k)
    build.prefill(list(paged.ids[:k]), 0, table, SamplingParams(), 0)
    next_token, logits, _, kv = paged.steps.step(paged.params, paged.fresh_kv(seed=5),
                                              build.build())
    assert rel_err(np.asarray(logits)[0], ref[k - 1]) < TOL
    assert int(next_token[0]) == ref[k - 1].argmax()
    for pos in range(k, SEQ_LEN):  # crosses page boundaries (and slides the window)
        build = paged.steps.builder(1, 0)
        build.decode(int(paged.ids[pos]), pos, table, SamplingParams(), 0)
        next_token, logits, _, kv = paged.steps.step(paged.params, kv, build.build())
        assert rel_err(np.asarray(logits)[0], ref[pos]) < TOL, f"position {pos}"
        assert int(next_token[0]) == ref[pos].argmax(), f"position {pos}"


def test_a_ragged_step_is_its_rows_alone(paged, one_shot):
    """Decode rows and another sequence's chunk in one step: each row's logits are what
    it gets alone (the one-shot's), whatever the padding rows and tokens hold."""
    ref, kv = one_shot
    table = paged.table(range(1, 8))
    free = list(range(8, NUM_PAGES))
    other = [free.pop() for _ in range(4)]
    decode_at = [60, 99, 31]  # three sequences sharing the one-shot's pages, read-only
    build = paged.steps.builder(len(decode_at), 30)
    for pos in decode_at:
        # the token at `pos` is already written: rewriting it leaves the pages as they are
        build.decode(int(paged.ids[pos]), pos, table, SamplingParams(), 0)
    build.prefill(list(paged.ids[:30]), 0, paged.table(other), SamplingParams(), 0)
    batch = build.build()
    assert (batch.decode_rows, batch.chunk) == (4, 32)  # a padding row, two padding tokens
    kv = jax.tree.map(jax.numpy.copy, kv)  # the step donates it; the fixture keeps its own
    _, logits, _, _ = paged.steps.step(paged.params, kv, batch)
    logits = np.asarray(logits)
    for j, pos in enumerate(decode_at):
        assert rel_err(logits[j], ref[pos]) < TOL, f"decode row at {pos}"
    assert rel_err(logits[4], ref[29]) < TOL, "the chunk's last token"


def test_a_few_decode_rows_are_each_row_alone(paged, one_shot):
    """A step of decode rows alone (3, padded to 4: its products are multiply-sums, see
    Buckets.reduce_rows): each row's logits and token are what it gets alone."""
    ref, kv = one_shot
    table = paged.table(range(1, 8))
    decode_at = [60, 99, 31]
    build = paged.steps.builder(len(decode_at), 0)
    for pos in decode_at:
        build.decode(int(paged.ids[pos]), pos, table, SamplingParams(), 0)
    kv = jax.tree.map(jax.numpy.copy, kv)
    tokens, logits, _, _ = paged.steps.step(paged.params, kv, build.build())
    for j, pos in enumerate(decode_at):
        assert rel_err(np.asarray(logits)[j], ref[pos]) < TOL, f"decode row at {pos}"
        assert int(tokens[j]) == ref[pos].argmax()


def test_padding_past_the_window_stays_harmless(zoo):
    """Padding queries more than a window past a row's last token see no key at all.

    They must neither turn the row's logits to NaN nor leave NaN in the shared scratch page,
    which every block table is padded with (0 * NaN = NaN for all later readers).
    """
    paged = Paged(zoo["mistral_window32"][1], zoo["mistral_window32"][0])
    ref, _ = paged.one_shot(paged.fresh_kv())
    assert paged.config.sliding_window == 32
    table = paged.table(range(1, 8))
    # 7 tokens padded to 48: padding positions 39..47 are > 32 past the last token (6)
    logits, kv = paged.all_logits(paged.fresh_kv(seed=6), [paged.ids[:7]], [0], [table], 48)
    assert rel_err(logits[0, :7], ref[:7]) < TOL
    assert np.isfinite(np.asarray(kv.k)).all() and np.isfinite(np.asarray(kv.v)).all()
    after, _ = paged.one_shot(kv)  # a later sequence reading the scratch page is unaffected
    assert rel_err(after, ref) < TOL


# ---------------------------------------------------------------- converted-params cache

def _assert_same_params(a, b):
    leaves_a = jax.tree_util.tree_leaves_with_path(a)
    leaves_b = jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    for (p, x), (_, y) in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype, jax.tree_util.keystr(p)
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(p))


def test_params_cache_hit(zoo, tmp_path):
    _, path = zoo["qwen2_bias"]
    first = load_weights(path, cache_dir=tmp_path)
    second = load_weights(path, cache_dir=tmp_path)
    assert not first.from_cache and second.from_cache
    assert second.config == first.config
    _assert_same_params(second.params, first.params)


def _truncate(file):
    os.truncate(file, os.path.getsize(file) // 2)


def _garble(file):
    """Invert 64 bytes in the middle of the file (its size is unchanged)."""
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        data = f.read(64)
        f.seek(os.path.getsize(file) // 2)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize("damage", [_truncate, _garble], ids=["truncated", "garbled"])
def test_params_cache_damaged_entry_is_rebuilt(zoo, tmp_path, caplog, damage):
    _, path = zoo["qwen2_bias"]
    fresh = load_weights(path, cache_dir=tmp_path)
    (entry,) = (tmp_path / "params").iterdir()
    files = [p for p in entry.rglob("*") if p.is_file()]
    damage(max(files, key=lambda p: p.stat().st_size))  # the largest file: the weights

    with caplog.at_level(logging.WARNING, logger="xlr_jax.loading.weights"):
        rebuilt = load_weights(path, cache_dir=tmp_path)
    assert not rebuilt.from_cache, "a damaged cache entry was trusted"
    assert any("converting again" in r.getMessage() for r in caplog.records)
    _assert_same_params(rebuilt.params, fresh.params)

    again = load_weights(path, cache_dir=tmp_path)  # the rebuilt entry serves the next load
    assert again.from_cache
    _assert_same_params(again.params, fresh.params)
