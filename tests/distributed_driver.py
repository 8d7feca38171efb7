"""One process of a model split across processes, run by tests/test_distributed.py:
`python tests/distributed_driver.py MODEL CACHE_DIR [COORDINATOR PROCESSES INDEX]` (with
XLA_FLAGS=--xla_force_host_platform_device_count=2; without the last three, one process
alone). Process 0 prints, as one JSON line,
the greedy tokens of PROMPTS, the tokens with a logits processor (drawn again after a
run-ahead step: the redraw), and the logits of the first prompt; the others follow."""
import json
import sys

import numpy as np

PROMPTS = ["t1 t2 t3", "t6 t1"]


def no_end_or_four(generated: list[int]) -> np.ndarray:
    """Bans EOS (0) and 4: the request runs its 12 tokens, decode steps ahead."""
    bias = np.zeros(8, np.float32)
    bias[[0, 4]] = -np.inf
    return bias


def outputs(model) -> dict:
    return {"greedy": [model.generate(p, max_tokens=12).token_ids for p in PROMPTS],
            "processed": model.generate(PROMPTS[0], max_tokens=12,
                                        logits_processor=no_end_or_four).token_ids,
            "logits": model.logits(PROMPTS[0]).tolist()}


def main(path, cache_dir, coordinator=None, processes=None, index=None) -> None:
    from xlr_jax.runtime import mirror

    mirror.initialize(coordinator, processes and int(processes), index and int(index), 5)
    import xlr_jax

    model = xlr_jax.load_model(path, cache_dir=cache_dir)
    if not model.leads:
        model.follow()
        return
    print(json.dumps({**outputs(model), "mesh": model.plan.mesh}), flush=True)
    model.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
