"""The soak's report: one JSON object (the figures, the invariants, and everything recorded) and
a PNG timeline (completed steps per node with the churn and fetches on it, group sizes, RSS, fds).

The figures:
    churn           events by kind; kills_in_round: kills that landed inside a round (the
                    victim's last event was "round"), kills_in_fetch: aimed at a fetch
    rounds          median and p95 round time (outer_step's round_s of nodes in a group), and
                    after each kill inside a round, how long the survivors' round of that step took
    steps           the swarm's last completed outer step, full-group share (steps whose group
                    held every node that completed the step)
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from swarm.cli.soak_schedule import KINDS

Event = Mapping[str, Any]


def figures(events: Sequence[Event], churn: Sequence[Event]) -> dict[str, Any]:
    steps = [e for e in events if e.get("event") == "outer_step" and isinstance(e.get("outer_step"), int)]
    grouped = [e for e in steps if e.get("group_id")]
    rounds = sorted(float(e.get("round_s") or 0) for e in grouped)
    median = statistics.median(rounds) if rounds else None
    by_step: dict[int, list[Event]] = defaultdict(list)
    for e in steps:
        by_step[e["outer_step"]].append(e)
    full = sum(
        1 for done in by_step.values() if len({e.get("group_id") for e in done}) == 1 and done[0].get("group_id")
    )
    kills = [c for c in churn if c["kind"].startswith("kill")]
    in_round = [c for c in kills if c.get("phase") == "round"]
    costs = []
    for c in in_round:  # the survivors' round of the step the victim was averaging
        victim = [
            e for e in events if e.get("slot") == c["slot"] and e.get("event") == "round" and e["time"] <= c["time"]
        ]
        if not victim:
            continue
        step = victim[-1]["outer_step"]
        after = [
            float(e.get("round_s") or 0) for e in by_step.get(step, []) if e.get("group_id") and e["time"] >= c["time"]
        ]
        if after:
            costs.append({"step": step, "round_s": round(max(after), 3)})
    return {
        "churn": {**{k: sum(1 for c in churn if c["kind"] == k) for k in KINDS},
                  "events": sum(1 for c in churn if c["kind"] in KINDS and c["kind"] != "load"),
                  "left": sum(1 for c in churn if c["kind"] == "leave"),
                  "kills_in_round": len(in_round),
                  "kills_in_fetch": sum(1 for c in kills if c.get("aimed") in ("fetcher", "beside_fetch"))},
        "rounds": {"count": len(rounds), "median_s": median and round(median, 3),
                   "p95_s": rounds and round(rounds[min(len(rounds) - 1, int(0.95 * len(rounds)))], 3),
                   "after_kill_in_round": costs,
                   "part_timeouts_s": sorted({float(e.get("part_timeout_s") or 0) for e in grouped})[-3:]},
        "steps": {"last": max(by_step, default=None),
                  "full_group_share": round(full / len(by_step), 3) if by_step else None,
                  "fetches": sum(1 for e in events if e.get("event") == "fetch")},
    }  # fmt: skip


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(report, separators=(",", ":")) + "\n")


def write_plot(
    path: Path, events: Sequence[Event], churn: Sequence[Event], samples: Sequence[Event], title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min((e["time"] for e in events), default=0.0)
    fig, (ax_steps, ax_groups, ax_rss, ax_fds) = plt.subplots(4, 1, figsize=(12, 11), sharex=True,
                                                               gridspec_kw={"height_ratios": [3, 1, 1, 1]})  # fmt: skip
    slots = sorted({e["slot"] for e in events}, key=lambda s: int(s[4:]) if s[4:].isdigit() else 0)
    for i, slot in enumerate(slots):
        mine = [e for e in events if e["slot"] == slot and e.get("event") == "outer_step"]
        ax_steps.plot([(e["time"] - t0) / 60 for e in mine], [e["outer_step"] for e in mine], ".", ms=2, label=slot,
                      color=plt.cm.tab20(i % 20))  # fmt: skip
        fetched = [e for e in events if e["slot"] == slot and e.get("event") == "fetch"]
        ax_steps.plot([(e["time"] - t0) / 60 for e in fetched], [e["outer_step"] for e in fetched], "x", ms=6,
                      color=plt.cm.tab20(i % 20))  # fmt: skip
    colors = {"kill": "red", "kill_round": "darkred", "kill_fetch": "orange", "term": "purple", "join": "green",
              "pause": "blue", "load": "grey", "restart": "lightgreen", "leave": "black"}  # fmt: skip
    for c in churn:
        if c["kind"] in colors:
            for ax in (ax_steps, ax_groups):
                ax.axvline((c["time"] - t0) / 60, color=colors[c["kind"]], lw=0.8, alpha=0.6)
    loads = [c for c in churn if c["kind"] == "load"]
    for c in loads:
        ax_steps.axvspan((c["time"] - t0) / 60, (c["time"] + c["seconds"] - t0) / 60, color="grey", alpha=0.15)
    ax_steps.set_ylabel("outer step completed (x: fetched)")
    ax_steps.legend(ncol=8, fontsize=6, loc="upper left")
    handles = [plt.Line2D([], [], color=col, label=kind) for kind, col in colors.items()]
    ax_groups.legend(handles=handles, ncol=8, fontsize=6, loc="lower left")
    steps = [e for e in events if e.get("event") == "outer_step"]
    ax_groups.plot([(e["time"] - t0) / 60 for e in steps], [e.get("group_size") or 1 for e in steps], ".", ms=2)
    ax_groups.set_ylabel("group size")
    for i, slot in enumerate(slots):
        mine = [s for s in samples if s["slot"] == slot]
        x = [(s["time"] - t0) / 60 for s in mine]
        ax_rss.plot(x, [s["rss_bytes"] / 1e6 for s in mine], ".", ms=1.5, color=plt.cm.tab20(i % 20))
        ax_fds.plot(x, [s["fds"] for s in mine], ".", ms=1.5, color=plt.cm.tab20(i % 20))
    ax_rss.set_ylabel("RSS (MB)")
    ax_fds.set_ylabel("open fds")
    ax_fds.set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summary(report: Mapping[str, Any]) -> list[str]:
    f, broken = report["figures"], {k: v for k, v in report["invariants"].items() if v}
    lines = [
        f"soak: {report['nodes']} nodes, {report['minutes']:g} min, last step {f['steps']['last']}, "
        f"full-group share {f['steps']['full_group_share']}, {f['steps']['fetches']} fetches",
        f"churn: {f['churn']['events']} events ({', '.join(f'{k} {v}' for k, v in f['churn'].items() if v)})",
        f"rounds: median {f['rounds']['median_s']} s, p95 {f['rounds']['p95_s']} s; after kills inside rounds: "
        + (", ".join(f"{c['round_s']} s" for c in f["rounds"]["after_kill_in_round"]) or "none"),
        f"tasks that failed and were restarted (seen): {len(report['seen_task_failures'])}",
    ]
    lines += [f"BROKEN {name}: {v}" for name, values in broken.items() for v in values[:10]]
    lines.append("invariants: all held" if not broken else f"invariants broken: {', '.join(broken)}")
    return lines
