"""`xlr probe`, `xlr plan` and `xlr roofline`: the hardware, the Execution Plan, the limits."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from xlr_jax.errors import InvalidRequestError

PHASE_ROWS = [  # (label, key, unit, scale)
    ("FLOPs", "flops", "GFLOP", 1e9), ("bytes", "bytes", "GB", 1e9),
    ("intensity", "intensity", "FLOP/B", 1), ("bound", "bound", "", None),
]


def cmd_probe(args) -> int:
    from xlr_jax.planning.hardware import probe

    hw = probe(measure=args.measure)
    if args.json:
        print(hw.to_json())
        return 0
    for key, value in json.loads(hw.to_json()).items():
        if key.endswith("_bytes"):
            value = f"{value / 1e9:.1f} GB"
        print(f"{key:>20}: {value}")
    print(f"{'ridge point':>20}: {hw.ridge_flops_per_byte:.1f} FLOP/byte")
    return 0


def _plan_for(args):
    from xlr_jax import load_model, plan
    from xlr_jax.planning.mapper import Workload

    options = dict(dtype=args.dtype, weights=args.weights, kv_dtype=args.kv_dtype,
                   page_size=args.page_size,
                   num_pages=args.num_pages, attn_impl=args.attn_impl,
                   linear_impl=args.linear_impl, tensor_parallel=args.tensor_parallel,
                   prefill_devices=args.prefill_devices)
    workload = dict(max_context=args.max_context, max_batch=args.max_batch,
                    prefill_chunk=args.prefill_chunk, max_step_tokens=args.max_step_tokens)
    if args.warmup:
        if args.hardware != "this":
            raise InvalidRequestError("--warmup compiles on this machine; drop --hardware")
        model = load_model(args.model, cache_dir=args.cache_dir,
                           prefix_cache=not args.no_prefix_cache, **options, **workload)
        return model.plan, model, model.config
    config = _model_config(args.model)
    return (plan(_hardware(args.hardware, args.devices), config, Workload(**workload), **options),
            None, config)


def cmd_plan(args) -> int:
    from xlr_jax.cli.main import say_kernels_off
    from xlr_jax.ops import cpu_kernels

    args.model = args.model_pos or args.model
    if args.fit:
        return _print_fit(args)
    if args.warmup:  # the kernels built now, a failure recorded before tried again
        cpu_kernels.build_error(retry=True)
    execution, model, config = _plan_for(args)
    say_kernels_off(execution)
    started = time.perf_counter()
    report = model.warmup() if model is not None else None
    warmup_s = time.perf_counter() - started
    if args.json:
        out = execution.to_dict()
        if report is not None:
            out["warmup"] = report
        print(json.dumps(out, indent=2))
        return 0
    out = execution.to_dict()
    reasons, memory = out.pop("reasons"), out.pop("memory")
    for key, value in out.items():
        note = f"   # {reasons[key]}" if key in reasons else ""
        print(f"{key:>16}: {value}{note}")
    print(f"{'buckets':>16}: # {reasons['buckets']}")
    if config.num_experts:
        print(f"{'experts':>16}: {_experts(config)}")
    print("          memory: " + ", ".join(f"{k.removesuffix('_bytes')} {v / 1e9:.3f} GB"
                                           for k, v in memory.items())
          + f"   # {reasons['memory']}")
    if report:
        times = [r["compile_s"] for r in report]
        print(f"          warmup: {len(times)} executables compiled in {warmup_s:.1f} s, "
              f"{os.cpu_count()} at a time (each {statistics.median(times):.2f} s median, "
              f"{max(times):.2f} s max)")
    return 0


def _experts(config) -> str:
    return (f"{config.num_experts} ({config.experts_per_token} active a token, "
            f"{config.shared_experts} shared)")


def _print_fit(args) -> int:
    from xlr_jax.planning.fit import fit

    hw, config = _hardware(args.hardware, args.devices), _model_config(args.model)
    table = fit(hw, config, args.context)
    if args.json:
        print(json.dumps({"model": args.model, **table}, indent=2))
        return 0
    print(f"{args.model} on {table['device']} ({table['memory_bytes'] / 1e9:.1f} GB free), "
          f"contexts of {table['context']} tokens, {table['page_size']}-token pages"
          + (f"; experts: {_experts(config)}" if config.num_experts else ""))
    print(f"{'weights':<9} {'KV':<14} {'weights GB':>10} {'KV kB/token':>12} "
          f"{'longest context':>16} {'sequences':>10}")
    for r in table["rows"]:
        tail = (f"{r['longest_context']:>16,} {r['largest_batch']:>10,}" if r["fits"]
                else f"  does not fit: {r['why'].split(';')[0]}")
        print(f"{r['weights']:<9} {r['kv']:<14} {r['weight_bytes'] / 1e9:>10.2f} "
              f"{r['kv_bytes_per_token'] / 1e3:>12.1f} {tail}")
    pick = table["plan"]
    if "error" in pick:
        print(f"the plan: nothing fits ({pick['error']})")
    else:
        print(f"the plan picks {pick['weights']} weights and {pick['kv']} KV, "
              f"{pick['num_pages']:,} pages ({pick['max_batch']} sequences at once, of up to "
              f"{pick['max_context']:,} tokens): {pick['why']}")
    return 0


def _hardware(name: str, devices: int | None = None):
    """This machine's profile, or a preset's; `devices`: that many of the device."""
    from xlr_jax.planning.hardware import preset, probe

    try:
        hw = probe() if name == "this" else preset(name)
    except ValueError as e:
        raise InvalidRequestError(str(e) + "; or 'this' for this machine") from None
    if devices is None:
        return hw
    if devices < 1:
        raise InvalidRequestError(f"--devices must be a positive integer (got {devices})")
    return dataclasses.replace(hw, device_count=devices)


def _model_config(name: str):
    from xlr_jax.loading.registry import resolve_model
    from xlr_jax.planning.roofline import PRESETS
    from xlr_jax.loading.weights import read_config

    if name in PRESETS:
        return PRESETS[name]
    path = resolve_model(name)
    if not path.exists():
        raise InvalidRequestError(f"unknown model {name!r}: give a preset "
                                  f"({', '.join(PRESETS)}) or a model path")
    return read_config(path)


def cmd_roofline(args) -> int:
    from xlr_jax.model.tensor_parallel import expert_parallel_for, problem, splits_head
    from xlr_jax.planning.roofline import estimate, measured_points, plot

    n = args.tensor_parallel
    hw = _hardware(args.hardware, n)
    config = _model_config(args.model)

    def splits(k: int) -> str | None:  # as the plan splits: experts whole where they divide
        return problem(config, k, expert_parallel_for(config, k))

    if (why := splits(n)) is not None:
        raise InvalidRequestError(f"--tensor-parallel {n}: {why}")
    # each split up to n (decode: where the all-reduces take over), n's figures printed
    by_split = {k: estimate(config, hw, prompt=args.prompt, batch=args.batch,
                            context=args.context, weight_bytes=args.weight_bytes,
                            kv_bytes=args.kv_bytes, name=Path(args.model).name,
                            tensor_parallel=k)
                for k in range(1, n + 1) if splits(k) is None}
    figures = by_split[n]
    if n > 1:
        figures["scaling"] = [{"tensor_parallel": k, "itl_s": f["itl_s"], "ttft_s": f["ttft_s"],
                               "decode_comm_share": f["decode_comm_share"]}
                              for k, f in by_split.items()]
    if args.plot:
        points = [p for f in args.measured for p in measured_points(json.loads(Path(f).read_text()))]
        plot(figures, hw, args.plot, points)
        figures["plot"] = args.plot
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    split = f" x {n}, a device's share" if n > 1 else ""
    print(f"{figures['model']} on {hw.device_name}{split} ({hw.peak_bandwidth_gb_s:.0f} GB/s, "
          f"{hw.peak_tflops:g} TFLOP/s, ridge {hw.ridge_flops_per_byte:.0f} FLOP/B): "
          f"{figures['params'] / 1e9:.2f} B params, {figures['active_params_per_token'] / 1e9:.2f} B "
          f"active per token, KV {figures['kv_bytes_per_token'] / 1e3:.0f} kB/token")
    print(f"{'':>18} {'prefill':>14} {'decode step':>14}")
    for label, key, unit, scale in PHASE_ROWS:
        pre = figures[f"prefill_{key}"]
        dec = figures[f"decode_{key}_per_step" if key in ("flops", "bytes") else f"decode_{key}"]
        fmt = (lambda v: str(v)) if scale is None else (lambda v: f"{v / scale:,.1f}")
        print(f"{label + (' (' + unit + ')' if unit else ''):>18} {fmt(pre):>14} {fmt(dec):>14}")
    print(f"{'time':>18} {figures['ttft_s'] * 1e3:>11.1f} ms {figures['itl_s'] * 1e3:>11.2f} ms"
          f"   (TTFT, ITL; {figures['decode_tokens_per_s']:,.0f} tok/s decode)")
    if n > 1:
        gathered = ", the logits gathered" if splits_head(config.vocab_size, n) else ""
        print(f"{'collectives':>18} {figures['prefill_comm_s'] * 1e3:>11.1f} ms "
              f"{figures['decode_comm_s'] * 1e3:>11.2f} ms   (2 all-reduces a layer"
              f"{gathered}; {hw.interconnect_gb_s:g} GB/s link a direction)")
        print(f"\n{'tensor parallel':>18} {'ITL':>10} {'communication share':>20}")
        for row in figures["scaling"]:
            print(f"{row['tensor_parallel']:>18} {row['itl_s'] * 1e3:>7.2f} ms "
                  f"{row['decode_comm_share']:>19.0%}")
        dominated = [r["tensor_parallel"] for r in figures["scaling"]
                     if r["decode_comm_share"] > 0.5]
        print("communication dominates decode from tensor parallel "
              f"{dominated[0]} on" if dominated else
              f"communication stays under half of decode up to tensor parallel {n}")
    if figures["weight_bytes"] > figures["device_memory_bytes"]:
        print(f"note: the weights ({figures['weight_bytes'] / 1e9:.0f} GB) exceed "
              f"{hw.device_name}'s {figures['device_memory_bytes'] / 1e9:.0f} GB: the figures "
              "assume they fit (more devices, or fewer bytes per weight)", file=sys.stderr)
    if args.plot:
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def add_cli(sub, add_model_options) -> None:
    p = sub.add_parser("probe", help="what this machine is: device, memory, peak rates",
                       description="Probe the hardware the mapper plans for.")
    p.add_argument("--measure", action="store_true",
                   help="measure copy bandwidth and a matmul rate on the spot")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("plan", help="the Execution Plan for a model on this machine",
                       description="Print the Execution Plan: every choice and why. "
                                   "Options override the mapper's choices.")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                   help="a preset (llama-3-8b, llama-3-70b, qwen2.5-72b, mixtral-8x7b, "
                        "qwen3-30b-a3b, ...), a model name or a path (default: the embedded "
                        "one); no weights are read")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--warmup", action="store_true",
                   help="build the CPU kernels (again, if a build failed), load the model "
                        "and compile every bucket ahead of time")
    p.add_argument("--hardware", default="this",
                   help="plan for a GPU from the table (h200, h100, a100-80gb, rtx4090, "
                        "rtx3090, ...) instead of this machine ('this', the default)")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="plan for N such devices (default: the machine's count, one for a "
                        "--hardware preset); a model too big for one is split over them")
    p.add_argument("--fit", action="store_true",
                   help="what fits: each weight format x KV dtype, with its bytes, the "
                        "longest context and the most sequences that fit, and the plan's pick")
    p.add_argument("--context", type=int, default=None,
                   help="--fit: tokens per sequence (default: the model's trained context)")
    add_model_options(p)
    for flag, what in (("--max-context", "context length"), ("--max-batch", "sequences at once"),
                       ("--prefill-chunk", "prefill tokens per step"),
                       ("--max-step-tokens", "tokens per step while requests decode"),
                       ("--page-size", "tokens per KV page"), ("--num-pages", "KV pages")):
        p.add_argument(flag, type=int, default=None, help=f"override: {what}")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("roofline", help="analytic FLOPs, bytes, TTFT and ITL against a device",
                       description="Roofline of one prefill and one decode step.")
    p.add_argument("model", metavar="MODEL",
                   help="a preset (llama-3-8b, llama-3-70b, qwen2.5-72b, mixtral-8x7b, "
                        "deepseek-v3-like) or a model name/path")
    p.add_argument("--hardware", default="h200",
                   help="a GPU from the table (h200, h100, a100, l4, rtx4090, ...) or 'this'")
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--context", type=int, default=None,
                   help="decode context (default: the prompt length)")
    p.add_argument("--weight-bytes", type=float, default=2, help="bytes per weight (bf16: 2)")
    p.add_argument("--kv-bytes", type=float, default=2, help="bytes per KV value (bf16: 2)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="each layer split over N devices: a device's figures, the "
                        "all-reduces over the device's link, and decode for each split to N")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--plot", metavar="PNG", default=None, help="draw the roofline to a PNG")
    p.add_argument("--measured", nargs="*", default=[], metavar="JSON",
                   help="xlr bench results whose decode points go on the plot")
    p.set_defaults(func=cmd_roofline)
