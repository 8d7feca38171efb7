"""Tensor parallel on the CPU: what splitting each layer over virtual devices costs.

Every virtual CPU device (XLA_FLAGS=--xla_force_host_platform_device_count=4, set here
unless a device count is set already) shares the same two cores, so a split model cannot
decode faster here: each shard's products are smaller, but the shards take turns on the
cores and every layer adds two all-reduces. This measures that overhead, side by side in
one process, interleaved, medians of --reps runs after a warm-up (compile) run:

- the embedded model (9 query heads, 3 KV heads) on one device and split over 3;
- a random Llama with 8 query heads and 4 KV heads (d 512, 8 layers, FFN 1536), saved
  by transformers, on 1, 2 and 4 devices.

Each: decode tokens/s of one stream (64 tokens after a 128-token prompt) and the time to
the first token, and their ratios to one device. --quick runs the random Llama alone,
small (a smoke test of the script; the tests check the embedded model's split).

Run: python experiments/tensor_parallel.py [--out experiments/results] [--reps 3] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

# the most any split here needs: XLA:CPU with more virtual devices runs every program
# slower, one device's too (experiments/README.md#tensor_parallel)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()

ROOT = Path(__file__).resolve().parent.parent
PROMPT = ("Tensor parallelism splits each layer's matrices across devices: attention "
          "heads go to different devices, and so do the columns of the feed-forward "
          "network. After the attention output and after the MLP, the partial results "
          "are summed across devices by an all-reduce. ")


def random_llama(root: Path, quick: bool) -> Path:
    """A random Llama with 8 query heads saved as a Hugging Face directory."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    d, layers, ffn = (128, 2, 256) if quick else (512, 8, 1536)
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=d, num_attention_heads=8,
                         num_key_value_heads=4, intermediate_size=ffn, vocab_size=4096,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=0)
    LlamaForCausalLM(config).float().eval().save_pretrained(root, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(4096)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w0"}))
    return root


def compare(model: str, splits: list[int], prompt: list[int] | str, tokens: int,
            reps: int) -> dict:
    from xlr_jax.bench.engines import load_xlr

    runners = {n: load_xlr({"model": model, "dtype": "float32", "tensor_parallel": n,
                            "label": f"tp{n}"}) for n in splits}
    ids = {n: r.encode(prompt) if isinstance(prompt, str) else prompt
           for n, r in runners.items()}
    outputs = {n: r.generate(ids[n], tokens).tokens for n, r in runners.items()}  # compile
    runs: dict[int, list] = {n: [] for n in splits}
    for _ in range(reps):  # interleaved
        for n, runner in runners.items():
            runs[n].append(runner.generate(ids[n], tokens))
    one = splits[0]
    figures = {}
    for n, rr in runs.items():
        decode = statistics.median(r.decode_tokens_per_s for r in rr)
        ttft = statistics.median(r.ttft_s for r in rr)
        figures[f"tp{n}"] = {"decode_tokens_per_s": decode, "ttft_s": ttft,
                             "decode_runs": [r.decode_tokens_per_s for r in rr],
                             "ttft_runs": [r.ttft_s for r in rr],
                             "same_tokens_as_one_device": outputs[n] == outputs[one]}
    base = figures[f"tp{one}"]
    for f in figures.values():
        f["decode_vs_one_device"] = f["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        f["ttft_vs_one_device"] = f["ttft_s"] / base["ttft_s"]
    return {"model": model, "prompt_tokens": len(next(iter(ids.values()))),
            "tokens": tokens, "figures": figures}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--reps", type=int, default=3, help="timed runs per figure (median)")
    ap.add_argument("--quick", action="store_true",
                    help="the small random Llama alone, small, one run: a smoke test")
    args = ap.parse_args(argv)
    from xlr_jax.bench.run import write_result

    reps, tokens = (1, 8) if args.quick else (args.reps, 64)
    with tempfile.TemporaryDirectory() as tmp:
        llama = random_llama(Path(tmp) / "llama8", args.quick)
        ids = [int(t) for t in range(1, 129)]
        result = {"what": "decode tokens/s and TTFT of a model split over virtual CPU "
                          "devices (tensor parallel) against one device, in one process, "
                          "interleaved"}
        if not args.quick:  # the smoke test runs the code path on the small model alone
            result["embedded"] = compare("smollm2", [1, 3], PROMPT * 3, tokens, reps)
        result["random_llama_8_heads"] = compare(str(llama), [1, 2, 4], ids, tokens, reps)
    path = write_result(args.out, "tensor_parallel", result, args.quick)
    for name in [n for n in ("embedded", "random_llama_8_heads") if n in result]:
        for split, f in result[name]["figures"].items():
            print(f"{name:>22} {split}: decode {f['decode_tokens_per_s']:7.1f} tok/s "
                  f"({f['decode_vs_one_device']:.2f}x), TTFT {f['ttft_s'] * 1e3:7.1f} ms "
                  f"({f['ttft_vs_one_device']:.2f}x), same tokens "
                  f"{f['same_tokens_as_one_device']}")
    print({"out": str(path)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
