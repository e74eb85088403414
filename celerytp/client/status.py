"""`celerytp status`: one screen of what a Redis's groups are doing: groups, ranks (alive, busy,
RSS), models with their replicas, queue depths and serving-loop figures (failed loops by kind
included); also as JSON.

Everything comes from Redis (heartbeats, the model registry, queues, loop flags and figures)
except each rank's RSS and models, which the rank workers answer to the `celerytp_status`
remote-control command (answered even while an op or a serving loop runs). Model paths are left
out: they name the host's model roots.
"""

from __future__ import annotations

import json
from typing import Any

from celerytp.client.registry import discover_groups, served
from celerytp.core.keys import dispatch_lock_key, inflight_key, loop_key, loop_stats_key, queue_key
from celerytp.core.liveness import read_owners
from celerytp.core.loop_failures import counted_loops, loop_failures

RECORD_FIELDS = ("quant", "dtype", "max_batch", "max_context", "max_queue", "vocab_size")


def _beat(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def rank_replies(leader: Any, names: list[str], timeout: float) -> list[dict[str, Any]]:
    """The `celerytp_status` answers of the named rank workers (a worker that does not answer in
    time is left out)."""
    if not names:
        return []
    answers = leader.app.control.broadcast(
        "celerytp_status", destination=names, reply=True, timeout=timeout, limit=len(names)
    ) or []
    return [reply for answer in answers for reply in answer.values() if isinstance(reply, dict)]


def cluster_status(leader: Any, timeout: float = 1.0) -> dict[str, Any]:
    """The status of every group and model on the leader's Redis, as a JSON-ready dict."""
    client = leader.redis
    models = served(client)
    groups = {leader.group: leader.world_size, **discover_groups(client)}
    for record in models.values():
        for group, size in record["replicas"].items():
            groups[group] = max(size, groups.get(group, 0))
    beats = {group: [_beat(v) for v in read_owners(client, group, size)] for group, size in sorted(groups.items())}
    names = [f"celerytp.{group}.rank{rank}@{beat.get('host', '')}"
             for group, ranks in beats.items() for rank, beat in enumerate(ranks) if beat]
    replies = {(r.get("group"), r.get("rank")): r for r in rank_replies(leader, names, timeout)}

    counted = counted_loops(client)  # a group that failed and is no replica any more is shown too
    loop_groups = {model: sorted({*record["replicas"], *(g for g, m in counted if m == model)})
                   for model, record in models.items()}
    failures = loop_failures(client, [(g, m) for m, groups in loop_groups.items() for g in groups])
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.llen(queue_key(model))
        for group in loop_groups[model]:
            pipe.exists(loop_key(group, model))
            pipe.llen(inflight_key(group, model))
            pipe.hgetall(loop_stats_key(group, model))
    for group in beats:
        pipe.exists(dispatch_lock_key(group))
    answers = iter(pipe.execute())

    model_rows, serving = [], {group: [] for group in beats}
    for model, record in models.items():
        loops = {}
        queued = next(answers)
        for group in loop_groups[model]:
            running, inflight, stats = next(answers), next(answers), next(answers)
            loops[group] = {"running": bool(running), "inflight": inflight,
                            **{k.decode(): int(float(v)) for k, v in stats.items()},
                            "failures": failures[(group, model)]}
            if running:
                serving.setdefault(group, []).append(model)
        model_rows.append({"model": model, "replicas": sorted(record["replicas"]), "queued": queued,
                           **{k: record.get(k) for k in RECORD_FIELDS if k in record}, "loops": loops})

    group_rows = []
    for group, ranks in beats.items():
        op_running = bool(next(answers))
        busy = bool(serving.get(group)) or op_running
        rank_rows = []
        for rank, beat in enumerate(ranks):
            reply = replies.get((group, rank), {})
            rank_rows.append({
                "rank": rank, "alive": beat is not None, "busy": busy and beat is not None,
                "host": (beat or {}).get("host"), "pid": (beat or {}).get("pid"),
                "device": reply.get("device", (beat or {}).get("device")),
                "rss_bytes": reply.get("rss_bytes"), "memory": reply.get("memory"), "models": reply.get("models"),
            })
        group_rows.append({
            "group": group, "world_size": len(ranks), "alive_ranks": sum(r["alive"] for r in rank_rows),
            "up": all(r["alive"] for r in rank_rows), "busy": busy, "op_running": op_running,
            "serving": sorted(serving.get(group, [])), "ranks": rank_rows,
        })
    return {"groups": group_rows, "models": model_rows}


def _memory(rank: dict[str, Any]) -> list[str]:
    """A live rank's rss, weights, KV cache and its device's free of total memory."""
    memory = rank.get("memory") or {}
    free = f"{_mib(memory.get('free'))} of {_mib(memory.get('total'))}" if memory else "?"
    return [_mib(rank["rss_bytes"]), _mib(memory.get("weights")), _mib(memory.get("kv_cache")), free]


def _mib(value: Any) -> str:
    return f"{value / 2**20:.0f} MiB" if isinstance(value, int | float) else "?"


def _failures(counts: dict[str, int]) -> str:
    """Failed loops by kind, "0" when none: `rank_lost=2,internal=1`."""
    return ",".join(f"{kind}={n}" for kind, n in sorted(counts.items(), key=lambda c: (-c[1], c[0]))) or "0"


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [headers, *[["-" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def render(status: dict[str, Any]) -> str:
    """The one-screen text form of `cluster_status`."""
    lines = ["GROUPS"]
    lines += table(["group", "ranks up", "busy", "serving"], [
        [g["group"], f"{g['alive_ranks']}/{g['world_size']}",
         "op" if g["op_running"] else _yes(g["busy"]), ",".join(g["serving"]) or "-"]
        for g in status["groups"]])
    lines += ["", "RANKS"]
    lines += table(["group", "rank", "alive", "busy", "host", "pid", "device", "rss", "weights", "kv", "device free",
                    "models"], [
        [g["group"], r["rank"], _yes(r["alive"]), _yes(r["busy"]), r["host"], r["pid"], r["device"],
         *(_memory(r) if r["alive"] else ["-"] * 4), ",".join(r["models"]) if r["models"] is not None else "?"]
        for g in status["groups"] for r in g["ranks"]])
    lines += ["", "MODELS"]
    if status["models"]:
        lines += table(["model", "replicas", "queued", "max_batch", "max_context", "quant"], [
            [m["model"], ",".join(m["replicas"]), m["queued"], m.get("max_batch"), m.get("max_context"), m.get("quant")]
            for m in status["models"]])
        lines += ["", "LOOPS"]
        headers = ["model", "group", "running", "rows", "inflight", "steps", "requests", "peak_rows", "reused_tokens",
                   "failures"]
        lines += table(headers, [
            [m["model"], group, _yes(loop["running"]), loop.get("running_rows", 0) if loop["running"] else 0,
             loop["inflight"], *(loop.get(k) for k in ("steps", "requests", "peak_rows", "reused_tokens")),
             _failures(loop.get("failures") or {})]
            for m in status["models"] for group, loop in sorted(m["loops"].items())])
    else:
        lines.append("(no model loaded)")
    return "\n".join(lines)
