"""``autotune worker``: join a shared study and evaluate candidates until the budget or the space runs out.

Many workers (processes, possibly on several nodes) run the same Optuna study through one RDB
storage (SQLite on one machine, PostgreSQL across machines). Every trial records its strategy key
right after ``ask()`` and claims it (autotune.claim): each candidate is evaluated once,
repeats reuse the first result, and a worker that dies mid-trial is detected by Optuna's heartbeat
and its trial re-queued for another worker. ::

    autotune worker --storage postgresql://tuner@db/autotune --study llama7b --config job.yaml \\
        [--create] [--trials N] [--backend profile] [--out runs]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any

from autotune.config import BACKENDS


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "worker", help="join a shared study (RDB storage) and evaluate candidates alongside other workers",
        description="Join the Optuna study NAME in the storage URL (created by `autotune run ... --storage URL "
        "--name NAME` or by the first `autotune worker --create`) and evaluate candidates until --trials "
        "evaluations are done or every candidate that fits has been evaluated. Start one worker per node "
        "(each profiles on its own GPUs); each candidate is evaluated by exactly one worker.")
    p.add_argument("--storage", required=True, metavar="URL",
                   help="shared Optuna storage: sqlite:///path.db (one machine) or postgresql://user@host/db")
    p.add_argument("--study", required=True, metavar="NAME", help="study name")
    p.add_argument("--config", metavar="CONFIG",
                   help="job file (default: the path recorded in the study by its creator)")
    p.add_argument("--create", action="store_true", help="create the study if it does not exist yet")
    p.add_argument("--trials", type=int, default=None, metavar="N",
                   help="evaluations by this worker (default: search.trials; 0 = only create/initialise)")
    p.add_argument("--backend", metavar="{" + ",".join(BACKENDS) + "}",
                   help="how candidates are measured (default: the config's profile.backend)")
    p.add_argument("--seed", type=int, metavar="N",
                   help="sampler seed (default: different per worker, so workers explore different points)")
    p.add_argument("--out", default="runs", metavar="DIR",
                   help="trial logs go to DIR/<study>/workers/<host>-<pid>/ (default: runs)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of a line")


def run(args: argparse.Namespace) -> int:
    import optuna

    from autotune.config import check_backend, load_config
    from autotune.trial_attrs import StudyAttrs
    from autotune.errors import ConfigError
    from autotune.backends.factory import make_backend
    from autotune.rundir import slowed
    from autotune.search import run_study
    from autotune.space import space_for
    from autotune.storage import make_storage

    if args.backend is not None:
        check_backend(args.backend, "--backend")
    if args.trials is not None and args.trials < 0:
        raise ConfigError(f"--trials must be >= 0, but got {args.trials}", path="--trials")
    if "://" not in args.storage:
        raise ConfigError("workers need an RDB URL (sqlite:///x.db, postgresql://...): Optuna's journal storage "
                          "has no heartbeat to recover a dead worker's trial", path="--storage")
    try:
        storage = make_storage(args.storage, heartbeat=True)
    except Exception as err:  # bad URL, missing driver, server down: one line, exit 2
        raise ConfigError(f"cannot open storage ({type(err).__name__}: {str(err).splitlines()[0][:200]})",
                          path="--storage") from None
    config = args.config
    if config is None:
        try:
            config = StudyAttrs.of(optuna.load_study(study_name=args.study, storage=storage)).config
        except KeyError:
            config = None
        if not config:
            raise ConfigError(f"study {args.study!r} does not exist or records no config; pass --config (and "
                              "--create for a new study)", path="--config")
    cfg = load_config(config)
    if not args.create:
        try:
            optuna.load_study(study_name=args.study, storage=storage)
        except KeyError:
            raise ConfigError(f"no study {args.study!r} in the storage; pass --create to create it",
                              path="--study") from None
    backend_name = args.backend or cfg.profile.backend
    log_dir = os.path.join(args.out, args.study, "workers", f"{socket.gethostname()}-{os.getpid()}")
    os.makedirs(log_dir, exist_ok=True)
    backend = slowed(make_backend(backend_name, cfg, log_dir))
    seed = args.seed if args.seed is not None else (os.getpid() * 7919 + int(time.time())) % (2**31 - 1)
    trials = cfg.search.trials if args.trials is None else args.trials
    start = time.perf_counter()
    outcome = run_study(cfg, space_for(cfg), backend, storage=storage, study_name=args.study,
                        n_trials=trials, seed=seed, sampler=cfg.search.sampler,
                        headroom=cfg.search.headroom, join=True, write_through=True)
    summary = {"study": args.study, "storage": args.storage, "worker": os.path.basename(log_dir),
               "evaluations": outcome.evaluations, "stopped": outcome.stop_reason,
               "interrupted": outcome.interrupted,
               "trials_in_study": len(outcome.study.get_trials(deepcopy=False)),
               "wall_s": round(time.perf_counter() - start, 2)}
    if args.json:
        print(json.dumps(summary))
    else:
        n = summary["evaluations"]
        print(f"worker {summary['worker']}: {n} evaluation{'' if n == 1 else 's'}, stopped because "
              f"{summary['stopped']}; study {args.study} has {summary['trials_in_study']} trials "
              f"({summary['wall_s']} s)")
    return 130 if outcome.interrupted else 0

