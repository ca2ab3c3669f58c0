"""Comparing finished runs (``autotune compare``, ``run --baseline``) and the nightly baseline links.

Everything here reads only the files of a run directory (front.json, trials.csv, run.json), so it
works for any finished run, wherever it was copied, without re-running or importing torch.

Exit statuses (``compare`` and ``run --baseline``): 0 unchanged or better, 1 regression beyond
``--max-regression``, 2 usage or input error (one line on stderr, via ConfigError).

What counts as a regression (each is listed in the output with the reason):

- the new run has no feasible point while the old one had;
- the recommended point (best.json: fastest that fits) lost more than the threshold in tokens/s;
- the recommended strategy is the same as before and needs more than the threshold more memory;
- a strategy that was on the old front now FAILS when measured (oom, crash, nan, timeout).

Points that merely left or joined the front, and old front strategies that the new run prunes
(memory model) or did not try, are reported but are not regressions by themselves: what matters
for the job is the recommended configuration.

Latest links (``update_latest``): ``<out>/latest-<config stem>`` points at the newest *accepted*
run of a config (one that had no baseline or did not regress against it); ``--baseline latest``
reads that link, so a regression keeps failing night after night until it is fixed or a run is
accepted by hand (``ln -sfn <run> runs/latest-<stem>`` or ``--baseline <run dir>``).
``<out>/latest`` always points at the newest finished run of any config (for people:
``autotune show runs/latest``, ``runs/latest/report.html``). Both are relative symlinks, so the
runs folder can be moved or archived as a whole.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, Optional

from autotune.errors import ConfigError
from autotune.runfiles import RunData, TrialRecord, load_run, point_memory_gib, strategy_key
from autotune.strategy import Strategy, strategy_from_dict

if TYPE_CHECKING:
    from autotune.config import Config

DEFAULT_MAX_REGRESSION = "5%"
"""Tolerated loss of the recommended point's tokens/s (``compare``, ``run --baseline``)."""


# ---------------------------------------------------------------- compare

def parse_threshold(spec: Any) -> float:
    """``5%``, ``5`` (percent) or a float fraction from code (0.05) -> 0.05."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        value = float(spec)
        if not 0 <= value < 1:
            raise ConfigError(f"expected a fraction in [0, 1), but got {spec!r}", path="--max-regression")
        return value
    text = str(spec).strip()
    try:
        value = float(text[:-1] if text.endswith("%") else text)
    except ValueError:
        raise ConfigError(f"expected a percentage like 5%, but got {spec!r}", path="--max-regression") from None
    if not 0 <= value < 100:
        raise ConfigError(f"expected a percentage in [0, 100), but got {spec!r}", path="--max-regression")
    return value / 100


def _pct(new: Optional[float], old: Optional[float]) -> Optional[float]:
    if new is None or old is None or old == 0:
        return None
    return (new - old) / old


def _gib(value: float) -> str:
    from autotune.output import format_gib

    return format_gib(value)


def _fmt_pct(p: Optional[float]) -> str:
    return "n/a" if p is None else f"{100 * p:+.1f}%"


def _front_by_key(front_obj: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """Every strategy on a front, each point's equivalents (within measurement resolution) included."""
    points = {}
    for p in front_obj["front"]:
        for q in (p, *p.get("equivalents", ())):
            points[strategy_key(q["strategy"])] = q
    return points


def _brief(p: dict[str, Any]) -> dict[str, Any]:
    """A front point as the comparison lists it."""
    return {"strategy_text": p["strategy_text"], "gpu_memory_gib": point_memory_gib(p),
            "tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"]}


def _outcome_now(records: list[TrialRecord]) -> dict[str, Any]:
    """How the new run ended a strategy that left the front: completed (dominated), failed, pruned,
    or not tried (its first trials count; repeats only when there is nothing else)."""
    rows = [r for r in records if not r.is_repeat] or records
    by_state = {}
    for r in reversed(rows):
        by_state[r.state] = r  # the first row of each state
    if "COMPLETE" in by_state:
        r = by_state["COMPLETE"]
        gib = r.peak_memory_gib if r.gpu_memory_gib is None else r.gpu_memory_gib
        return {"state": "COMPLETE (dominated)", "gpu_memory_gib": gib,
                "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu}
    if "FAIL" in by_state:
        return {"state": "FAIL", "reason": by_state["FAIL"].fail_reason}
    if "PRUNED" in by_state:
        return {"state": "PRUNED", "reason": by_state["PRUNED"].prune_reason}
    return {"state": "not tried"}


def compare_runs(old: RunData, new: RunData, max_regression: float) -> dict[str, Any]:
    """What changed between two runs, and whether it is a regression (a JSON-able dict)."""
    old_front = _front_by_key(old.front)
    new_front = _front_by_key(new.front)
    new_rows: dict[tuple, list[TrialRecord]] = {}
    for rec in new.records:
        new_rows.setdefault(rec.strategy.key(), []).append(rec)

    left, now_failing, now_pruned, not_tried = [], [], [], []
    for key, p in old_front.items():
        if key in new_front:
            continue
        entry = {**_brief(p), "now": _outcome_now(new_rows.get(key, []))}
        {"FAIL": now_failing, "PRUNED": now_pruned, "not tried": not_tried}.get(entry["now"]["state"], []).append(entry)
        left.append(entry)
    order = {"FAIL": 0, "PRUNED": 1, "not tried": 2}
    left.sort(key=lambda e: order.get(e["now"]["state"], 3))  # the ones that matter first
    joined = [_brief(p) for k, p in new_front.items() if k not in old_front]
    stayed = []
    for key, p in new_front.items():
        if key in old_front:
            o = old_front[key]
            stayed.append({**_brief(p), "memory_change": _pct(point_memory_gib(p), point_memory_gib(o)),
                           "throughput_change": _pct(p["tokens_per_s_per_gpu"], o["tokens_per_s_per_gpu"])})

    ob, nb = old.best, new.best
    best: dict[str, Any] = {"old": ob and _brief(ob), "new": nb and _brief(nb), "same_strategy": False,
                            "throughput_change": None, "memory_change": None}
    regressions: list[str] = []
    if ob and nb:
        best["same_strategy"] = strategy_key(ob["strategy"]) == strategy_key(nb["strategy"])
        best["throughput_change"] = _pct(nb["tokens_per_s_per_gpu"], ob["tokens_per_s_per_gpu"])
        best["memory_change"] = _pct(point_memory_gib(nb), point_memory_gib(ob))
        if best["throughput_change"] is not None and best["throughput_change"] < -max_regression:
            regressions.append(f"recommended throughput {_fmt_pct(best['throughput_change'])} "
                               f"({ob['tokens_per_s_per_gpu']:,.0f} -> {nb['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU)")
        if best["same_strategy"] and best["memory_change"] is not None and best["memory_change"] > max_regression:
            regressions.append(f"recommended strategy needs {_fmt_pct(best['memory_change'])} memory "
                               f"({_gib(point_memory_gib(ob))} -> {_gib(point_memory_gib(nb))})")
    elif ob and not nb:
        regressions.append("no candidate fits any more (the old run recommended "
                           f"{ob['strategy_text']})")
    for e in now_failing:
        regressions.append(f"old front point now fails: {e['strategy_text']} ({e['now']['reason']})")

    notes = []
    for what in ("model", "backend", "space"):
        if old.front.get(what) != new.front.get(what):
            notes.append(f"{what} differs: {old.front.get(what)} -> {new.front.get(what)}")
    if old.front.get("hardware") != new.front.get("hardware"):
        notes.append(f"hardware differs: {old.front.get('hardware')} -> {new.front.get('hardware')}")
    return {
        "old": old.run_dir, "new": new.run_dir, "max_regression": max_regression,
        "front_size": {"old": len(old_front), "new": len(new_front)},
        "left_front": left, "joined_front": joined, "stayed_on_front": stayed,
        "old_front_now_failing": now_failing, "old_front_now_pruned": now_pruned, "old_front_not_tried": not_tried,
        "recommended": best, "notes": notes, "regressions": regressions,
        "verdict": "regression" if regressions else "ok",
        "exit_status": 1 if regressions else 0,
    }


LIST_LIMIT = 12
"""Lines per list in the text output (--json has everything)."""


def _capped(items: list, lines: list[str]) -> list:
    if len(items) > LIST_LIMIT:
        lines.append(f"  ({len(items) - LIST_LIMIT} more not shown; --json lists all)")
    return items[:LIST_LIMIT]


def format_compare(c: dict[str, Any]) -> str:
    thr = f"{100 * c['max_regression']:g}%"
    lines = [f"compare {c['old']} -> {c['new']}  (max regression {thr})"]
    lines += [f"note: {n}" for n in c["notes"]]
    lines.append(f"front: {c['front_size']['old']} -> {c['front_size']['new']} points, "
                 f"{len(c['stayed_on_front'])} kept, {len(c['left_front'])} left, {len(c['joined_front'])} joined")
    b = c["recommended"]
    if b["old"] and b["new"]:
        same = "same strategy" if b["same_strategy"] else "strategy changed"
        lines.append(f"recommended ({same}): throughput {_fmt_pct(b['throughput_change'])}, "
                     f"memory {_fmt_pct(b['memory_change'])}")
        lines.append(f"  old: {b['old']['strategy_text']}: {_gib(b['old']['gpu_memory_gib'])}, "
                     f"{b['old']['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU")
        lines.append(f"  new: {b['new']['strategy_text']}: {_gib(b['new']['gpu_memory_gib'])}, "
                     f"{b['new']['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU")
    else:
        lines.append(f"recommended: old {b['old'] and b['old']['strategy_text'] or 'none'}, "
                     f"new {b['new'] and b['new']['strategy_text'] or 'none'}")
    for title, items in (("left the front", c["left_front"]), ("joined the front", c["joined_front"])):
        if items:
            lines.append(f"{title}:")
            tail_lines: list[str] = []
            for e in _capped(items, tail_lines):
                now = e.get("now")
                tail = ""
                if now:
                    tail = f"  -> now {now['state']}" + (f": {now['reason']}" if now.get("reason") else "")
                lines.append(f"  {_gib(e['gpu_memory_gib']):>12} {e['tokens_per_s_per_gpu']:>12,.0f} tok/s  "
                             f"{e['strategy_text']}{tail}")
            lines += tail_lines
    moved = [e for e in c["stayed_on_front"]
             if (e["throughput_change"] or 0) != 0 or (e["memory_change"] or 0) != 0]
    if moved:
        lines.append("kept on the front, re-measured:")
        tail_lines = []
        for e in _capped(moved, tail_lines):
            lines.append(f"  throughput {_fmt_pct(e['throughput_change']):>7}, memory {_fmt_pct(e['memory_change']):>7}"
                         f"  {e['strategy_text']}")
        lines += tail_lines
    if c["regressions"]:
        lines.append("REGRESSION:")
        lines += [f"  - {r}" for r in c["regressions"]]
    else:
        lines.append("verdict: unchanged or better")
    return "\n".join(lines)


def run_compare(old_dir: str, new_dir: str, max_regression: Any = DEFAULT_MAX_REGRESSION,
                as_json: bool = False) -> int:
    """Compare two run directories, print the result, return the exit status (0 or 1)."""
    threshold = parse_threshold(max_regression)
    old, new = load_run(old_dir), load_run(new_dir)
    if os.path.realpath(old.run_dir) == os.path.realpath(new.run_dir):  # e.g. a latest link moved to NEW_RUN
        raise ConfigError(f"{old_dir} and {new_dir} are the same run ({os.path.realpath(new.run_dir)}); compare "
                          "needs two different runs", path="NEW_RUN")
    c = compare_runs(old, new, threshold)
    print(json.dumps(c, indent=2) if as_json else format_compare(c))
    return c["exit_status"]


# ---------------------------------------------------------------- nightly baselines

def baseline_compare(run_dir: str, baseline_dir: str, max_regression: Any = DEFAULT_MAX_REGRESSION,
                     as_json: bool = False) -> int:
    """After ``autotune run --baseline``: compare the new run against its baseline; the exit status.
    With ``as_json`` the comparison goes to stderr (stdout carries front.json)."""
    threshold = parse_threshold(max_regression)
    c = compare_runs(load_run(baseline_dir), load_run(run_dir), threshold)
    if as_json:
        print(json.dumps(c, indent=2), file=sys.stderr)
    else:
        print("\n" + format_compare(c))
    with open(os.path.join(run_dir, "compare.json"), "w") as fh:
        json.dump({**c, "baseline": os.path.abspath(baseline_dir)}, fh, indent=2)
        fh.write("\n")
    return c["exit_status"]


def latest_link_name(config_stem: str) -> str:
    return f"latest-{config_stem}"


def config_stem(config_path: str) -> str:
    return os.path.splitext(os.path.basename(config_path))[0]


def resolve_baseline(out_dir: str, config_path: str, spec: Optional[str]) -> Optional[str]:
    """The baseline run directory for ``--baseline SPEC``: a run directory, or ``latest`` (the
    config's ``<out>/latest-<stem>`` link). Call it *before* the run, so a bad baseline fails fast.
    Returns None (with a note on stderr) for ``latest`` when the config has no accepted run yet:
    the first nightly run becomes the baseline."""
    if not spec:
        return None
    if spec == "latest":
        link = os.path.join(out_dir, latest_link_name(config_stem(config_path)))
        if not os.path.lexists(link):
            print(f"autotune: no baseline yet ({link} does not exist); this run will become it", file=sys.stderr)
            return None
        if not os.path.exists(link):
            raise ConfigError(f"broken link to {os.readlink(link)}", file=link, path="--baseline")
        target = os.path.realpath(link)
        load_run(target)
        return target
    try:
        load_run(spec)
    except ConfigError as err:
        raise ConfigError(err.message, file=err.file, path="--baseline") from None
    return spec


def _point_link(out_dir: str, link_name: str, run_dir: str) -> str:
    link = os.path.join(out_dir, link_name)
    if os.path.exists(link) and not os.path.islink(link):
        raise ConfigError("exists and is not a symlink; not replacing it", file=link)
    target = os.path.relpath(os.path.abspath(run_dir), os.path.abspath(out_dir))
    tmp = f"{link}.tmp{os.getpid()}"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)  # atomic: readers never see a missing link
    return link


def update_latest(out_dir: str, run_dir: str, config_stem: str, accepted: bool = True) -> list[str]:
    """Point ``<out>/latest`` at ``run_dir``, and ``<out>/latest-<stem>`` too when the run is accepted
    as the config's next baseline (no regression). Returns the links written."""
    links = [_point_link(out_dir, "latest", run_dir)]
    if accepted:
        links.append(_point_link(out_dir, latest_link_name(config_stem), run_dir))
    return links


def baseline_seeds(baseline_dir: str, cfg: Optional[Config] = None) -> list[Strategy]:
    """The baseline front's strategies, recommended point first, then memory ascending: enqueue
    them so a nightly run re-measures yesterday's front before exploring. With the new run's
    ``cfg``, strategies outside its search space (the space file may have changed) are dropped."""
    run = load_run(baseline_dir)
    points = list(run.front["front"])
    best = run.best
    if best:
        points.sort(key=lambda p: p["trial"] != best["trial"])
    space = None
    if cfg is not None:
        from autotune.space import space_for

        space = space_for(cfg)
    seeds = []
    for p in points:
        try:
            s = strategy_from_dict(p["strategy"])
        except (TypeError, KeyError):
            raise ConfigError(f"front.json has an unreadable strategy at trial {p.get('trial')}",
                              file=os.path.join(baseline_dir, "front.json")) from None
        if space is not None and not space.contains(s, cfg.model):
            continue
        seeds.append(s)
    return seeds
