"""``tq-redis demo``: the main job -- a GRPO-shaped pipeline of independent processes.

On the embedded default (a Valkey plus two local DRAM storage nodes, started and stopped here)
six worker processes that know nothing but the Redis URL and the namespace stream one partition
per training step, ``step_<k>``, through five stages:

* **feeder**   inserts the step's prompts, each repeated ``n_samples`` times (one GRPO group)
  and tagged with a ``uid`` per prompt, then seals the partition;
* **rollout**  (``--workers`` processes) claim whole groups (``GRPOGroupNSampler``) and generate
  variable-length responses token by token with a tiny bigram policy (jagged nested tensors),
  tagging each sample with ``total_lengths`` (prompt + response tokens);
* **reward**   claims whole groups, scores them and writes rewards and group-normalised
  advantages;
* **ref**      writes reference-policy log-probs of every response token;
* **trainer**  claims token-budget micro-batches (``sampling_config={"max_tokens": T}``),
  runs a GRPO update on each, and clears the partition once the step is done.

Every stage claims micro-batches as soon as their inputs are produced, so the stages overlap:
the reward worker starts on a step's first groups while rollout is still generating the rest.
Generation and scoring cost is simulated with bounded CPU work proportional to the number of
tokens (never with sleeps). The rollout of step ``k`` starts once the trainer has finished step
``k - max_lag`` (``--max-lag 0``: strictly on-policy).

Each worker reports ``(stage, worker, step, start, end, n)`` spans to this process over a
multiprocessing queue; this process draws per-stage progress bars (rich; plain lines when stdout
is not a terminal), prints a summary (samples, bytes moved, per-stage busy time, wall time and
the overlap gained over running the stages one after another) and writes a timeline PNG
(matplotlib) plus ``summary.json`` and ``spans.json`` to ``--out``.

Run: ``python -m tq_redis.demo.main [--steps 3] [--batch 16] [--n-samples 4] [--workers 2]``
(``--redis URL`` attaches to an existing Redis instead: storage nodes must already be running
there, e.g. ``tq-redis up``, or pass ``--store redis``).

This module is the command line and the public face; the demo lives in one module per job:

* :mod:`tq_redis.demo.config`   the options, stage names, span record and error every process shares;
* :mod:`tq_redis.demo.workload` the simulated work (bigram policy, rewards, GRPO update, CPU cost),
  pure torch, also run by ``benchmarks/p5_pipeline.py``;
* :mod:`tq_redis.demo.stages`   the worker processes: one function per stage, moving data through tq-redis;
* :mod:`tq_redis.demo.pipeline` the main process: start, watch and stop the workers (:func:`run_demo`);
* :mod:`tq_redis.demo.report`   progress bars, the summary and the timeline figure.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import Any

from tq_redis.demo.config import STAGES, DemoConfig, DemoFailed, Span
from tq_redis.demo.pipeline import run_demo
from tq_redis.demo.report import format_summary
from tq_redis.settings import settings

__all__ = ["STAGES", "DemoConfig", "DemoFailed", "Span", "build_parser", "format_summary", "main", "run_demo"]


def build_parser() -> argparse.ArgumentParser:
    """The ``tq-redis demo`` options."""
    d = DemoConfig()
    p = argparse.ArgumentParser(
        prog="tq-redis demo",
        description="GRPO-shaped rollout -> reward -> ref log-prob -> trainer pipeline of independent processes, "
        "streaming one partition per step through tq-redis.",
    )
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps, one partition each ({d.steps})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"prompts per step ({d.batch})")
    p.add_argument(
        "--n-samples", type=int, default=d.n_samples, help=f"responses per prompt, one GRPO group ({d.n_samples})"
    )
    p.add_argument("--workers", type=int, default=d.workers, help=f"rollout worker processes ({d.workers})")
    p.add_argument("--store", choices=("dram", "redis"), default=d.store, help=f"tensor store ({d.store})")
    p.add_argument(
        "--redis",
        metavar="URL",
        default=None,
        help="attach to this Redis instead of starting an embedded Valkey (with --store dram its storage "
        "nodes must already be running, e.g. tq-redis up)",
    )
    p.add_argument(
        "--namespace",
        default=settings.namespace or d.namespace,
        help="key namespace (default: $TQ_NAMESPACE or tq)",
    )
    p.add_argument("--out", default=d.out, help=f"directory for the timeline PNG and JSON ({d.out})")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=d.max_tokens,
        help=f"trainer token budget per micro-batch, by total_lengths; 0: fixed micro-batches ({d.max_tokens})",
    )
    p.add_argument(
        "--micro-batch", type=int, default=d.micro_batch, help=f"most samples per trainer micro-batch ({d.micro_batch})"
    )
    p.add_argument(
        "--max-lag",
        type=int,
        default=d.max_lag,
        help=f"steps rollout may run ahead of the trainer; 0 = on-policy ({d.max_lag})",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--timeout", type=float, default=d.timeout_s, help=f"give up after this many seconds ({d.timeout_s:.0f})"
    )
    p.add_argument(
        "--progress",
        choices=("auto", "rich", "plain", "none"),
        default=d.progress,
        help="progress bars (auto: rich on a terminal, plain lines otherwise)",
    )
    p.add_argument("--fail-stage", choices=STAGES, default=None, help=argparse.SUPPRESS)  # tests: inject a failure
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``tq-redis demo``: run the pipeline, print the summary; 0 on success, 1 on failure, 130 on Ctrl-C."""
    from tq_redis.errors import TQError

    args = build_parser().parse_args(argv)
    cfg = DemoConfig(
        steps=args.steps,
        batch=args.batch,
        n_samples=args.n_samples,
        workers=args.workers,
        store=args.store,
        redis_url=args.redis,
        namespace=args.namespace,
        out=args.out,
        max_tokens=args.max_tokens,
        micro_batch=args.micro_batch,
        max_lag=args.max_lag,
        seed=args.seed,
        timeout_s=args.timeout,
        progress=args.progress,
        fail_stage=args.fail_stage,
    )
    try:
        cfg.validate()
    except ValueError as exc:
        print(f"tq-redis demo: {exc}", file=sys.stderr)
        return 2

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM: clean up exactly as on Ctrl-C

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        summary = run_demo(cfg)
    except (DemoFailed, TQError) as exc:
        print(f"tq-redis demo FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tq-redis demo: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
