"""What a constrained request costs a decode batch (issue 16 §1): plain streams decoding
alone, against the same streams beside one request held to a JSON schema (llguidance's token
mask each step), in one process, the two taking turns every round.

A step that carries a masked row runs ahead like any decode step: its mask is computed from
the tokens just read back while the step runs, and the masked row is drawn again from the
step's logits with it (Engine._bias_late). Figures, medians over rounds: the plain streams'
mean inter-token latency (ITL) alone and beside the masked request; the masked request's own
ITL, which is the step time with a masked row (it shares every step it decodes in with the
plain rows, and may close its object before they end), over the plain streams' alone; and
the mask's cost per token (llguidance's time per mask, as /metrics counts it).

Run: python experiments/constrained_decode.py [--out experiments/results] [--rounds 5]
     [--streams 3] [--quick]
"""
from __future__ import annotations

import statistics
from pathlib import Path

from xlr_jax.bench.load import experiment_parser, experiment_settings

SCHEMA = {"type": "object", "required": ["items"],
          "properties": {"items": {"type": "array", "items": {"type": "string"}},
                         "done": {"type": "boolean"}}}
PROMPTS = ["List the planets you know.", "Name some rivers of Europe.",
           "Write three facts about owls.", "Describe bread making.",
           "Which metals conduct heat well?"]


def one_round(model, grammars, streams: int, tokens: int, masked: bool) -> dict:
    """`streams` plain chat requests of `tokens` tokens (EOS ignored), with or without one
    request held to SCHEMA beside them; their mean ITLs and the masked one's figures."""
    chats = [model.encode([{"role": "user", "content": p}])[0] for p in PROMPTS]
    plain = [model.submit(chats[i % len(chats)], max_tokens=tokens, ignore_eos=True)
             for i in range(streams)]
    held = None
    if masked:
        constraint = grammars.json_schema(SCHEMA, tokens)
        held = model.submit(chats[-1], max_tokens=tokens, logits_processor=constraint)
    itl = [h.result().metrics["itl_s"] for h in plain]
    out = {"plain_itl_s": statistics.mean(itl)}
    if held is not None:
        r = held.result()
        out.update(masked_itl_s=r.metrics["itl_s"], masked_tokens=len(r.token_ids),
                   mask_s_per_token=constraint.mask_seconds / max(constraint.masks, 1))
    return out


def main(argv=None) -> dict:
    ap = experiment_parser(__doc__, Path("experiments/results"))
    ap.add_argument("--streams", type=int, default=3, help="plain streams decoding")
    args = ap.parse_args(argv)
    s = experiment_settings(args, {"rounds": 5, "tokens": 64}, {"rounds": 1, "tokens": 8})

    import xlr_jax
    from xlr_jax.bench.run import write_result
    from xlr_jax.server.constraints import Grammars

    model = xlr_jax.load_model("smollm2", dtype="float32", cache_dir=args.cache_dir)
    grammars = Grammars(model.tokenizer, model.engine.config.vocab_size)
    try:
        for masked in (False, True):  # compiles every shape both need
            one_round(model, grammars, args.streams, s["tokens"], masked)
        rounds = [{masked: one_round(model, grammars, args.streams, s["tokens"], masked)
                   for masked in (False, True)} for _ in range(s["rounds"])]
    finally:
        model.shutdown()
    med = lambda key, masked: statistics.median(r[masked][key] for r in rounds)  # noqa: E731
    figures = {"plain_itl_alone_s": med("plain_itl_s", False),
               "plain_itl_beside_masked_s": med("plain_itl_s", True),
               "masked_itl_s": med("masked_itl_s", True),
               "mask_s_per_token": med("mask_s_per_token", True)}
    # the masked request decodes in the steps it shares with the plain rows: its ITL is
    # the step time with a masked row (it may close its object before they end)
    figures["masked_step_over_plain"] = figures["masked_itl_s"] / figures["plain_itl_alone_s"]
    result = {"what": "plain decode streams alone and beside one JSON-schema-constrained "
                      "request (late mask); medians over interleaved rounds",
              "config": {"streams": args.streams, **s, "schema": SCHEMA},
              "figures": figures, "rounds": [{"alone": r[False], "beside_masked": r[True]}
                                             for r in rounds]}
    path = write_result(args.out, "constrained_decode", result, args.quick)
    print(f"plain ITL alone {figures['plain_itl_alone_s'] * 1e3:.1f} ms, beside a masked "
          f"request {figures['plain_itl_beside_masked_s'] * 1e3:.1f} ms; masked ITL "
          f"{figures['masked_itl_s'] * 1e3:.1f} ms "
          f"({figures['masked_step_over_plain']:.2f}x the plain alone); mask "
          f"{figures['mask_s_per_token'] * 1e3:.3f} ms/token\n{path}")
    return result


if __name__ == "__main__":
    main()
