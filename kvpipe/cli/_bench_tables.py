"""The file-store and Mooncake tables of ``kvpipe bench``: markdown for the docs, rich tables
for the terminal."""

from __future__ import annotations

from typing import Any, Final

from rich.table import Table

__all__ = ("file_markdown", "file_table", "mooncake_markdown", "mooncake_table")

_WHERE: Final = {"local": "this process", "remote": "another process"}


_FILE_OPS: Final = (
    ("write", "write"),
    ("read_hot", "read, page cache"),
    ("read_cold", "read, evicted"),
)
_WRITE_COLS: Final = (("raw1", "raw x1"), ("raw4", "raw x4"), ("direct4", "O_DIRECT x4"))
_HAND_COLS: Final = (("hand1", "hand-written x1"), ("hand2", "hand-written x2"))
#: The columns of each table: no O_DIRECT read among the page-cache reads (it skips the cache).
_COLS: Final = {
    "write": _WRITE_COLS,
    "read_hot": (*_WRITE_COLS[:2], *_HAND_COLS),
    "read_cold": (*_WRITE_COLS, *_HAND_COLS),
}


def file_markdown(records: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for op, title in _FILE_OPS:
        cols = _COLS[op]
        lines += [
            f"| block | durability | {title} | pipeline GB/s (median / best) | "
            + " | ".join(f"{c} GB/s" for _, c in cols)
            + " | ratio to best | "
            + " | ".join(f"vs {c}" for _, c in cols)
            + " |",
            "| --- " * (4 + 2 * len(cols) + 1) + "|",
        ]
        for r in records:
            if op not in r:
                continue
            w = r[op]
            lines.append(
                f"| {r['block_size']} | {r['durability']} | {title} | "
                f"{w['gbps_median']} / {w['gbps_best']} | "
                + " | ".join(str(w[f"{k}_gbps_median"]) for k, _ in cols)
                + f" | **{w['ratio_median']}** | "
                + " | ".join(str(w[f"ratio_vs_{k}"]) for k, _ in cols)
                + " |"
            )
        lines.append("")
    if all("slice_block_num" in r for r in records):
        slices = ", ".join(
            dict.fromkeys(f"{r['block_size']}: {r['slice_block_num']}" for r in records)
        )
        lines += [
            f"Pipeline: requests of {records[0]['request_blocks']} blocks, all in flight at "
            f"once; slices of {slices} blocks; file store threads={records[0]['store_threads']}"
            f"{', cached_writes=True' if records[0].get('cached_writes') else ''}; checksums "
            "on. Ratios are medians of per-round ratios (contenders run interleaved).",
            "",
        ]
    return lines


def mooncake_markdown(records: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| block | data in | write | pipeline GB/s (median / best) | put_from GB/s | "
        "upsert_from GB/s | ratio (median) | vs put_from | vs upsert_from | hand loop GB/s | "
        "hand loop vs direct | pipeline vs hand loop |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        w = r["write"]
        lines.append(
            f"| {r['block_size']} | {_WHERE[r['placement']]} | write | "
            f"{w['gbps_median']} / {w['gbps_best']} | {w['put_from_gbps_median']} | "
            f"{w['upsert_from_gbps_median']} | **{w['ratio_median']}** | "
            f"{w['ratio_vs_put_from']} | {w['ratio_vs_upsert_from']} | {_loop_cells(w)} |"
        )
    lines += [
        "",
        "| block | data in | read | pipeline GB/s (median / best) | get_into GB/s | "
        "ratio (median) | hand loop GB/s | hand loop vs direct | pipeline vs hand loop |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        g = r["read"]
        lines.append(
            f"| {r['block_size']} | {_WHERE[r['placement']]} | read | "
            f"{g['gbps_median']} / {g['gbps_best']} | {g['get_into_gbps_median']} | "
            f"**{g['ratio_median']}** | {_loop_cells(g)} |"
        )
    return [*lines, "", _pipeline_line(records), ""]


def _loop_cells(summary: dict[str, Any]) -> str:
    """The hand-loop columns of a Mooncake row (``-`` for records from before it ran)."""
    keys = ("loop_gbps_median", "loop_vs_direct", "ratio_vs_loop")
    return " | ".join(str(summary.get(k, "-")) for k in keys)


def _pipeline_line(records: list[dict[str, Any]]) -> str:
    """How the pipeline of a Mooncake run was configured, in one sentence."""
    p = records[0]["pipeline"]
    blocks = {r["block_size"]: r["pipeline"]["slice_block_num"] for r in records}
    mib = max(r["pipeline"]["slice_block_num"] * r["value_bytes"] for r in records) / (1 << 20)
    per_size = ", ".join(f"{size}: {n} blocks" for size, n in blocks.items())
    slices = -(-p["request_blocks"] // p["slice_block_num"])
    return (
        f"Pipeline: {p['concurrency']} requests in flight, each of {slices} slices of "
        f"~{mib:.3g} MiB ({per_size}); io_threads={p['io_threads']}; checksums "
        f"{'on' if p['verify_checksums'] else 'off'}."
    )


def file_table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="kvpipe bench: pipeline over the file store vs plain file I/O")
    cols = ("block", "op", "pipeline GB/s", "raw x1/x4/direct", "hand x1/x2", "ratio")
    for col in cols:
        table.add_column(col, justify="right")
    for r in records:
        for op, title in _FILE_OPS:
            w = r[op]
            hands = ("hand1", "hand2") if op != "write" else ()
            table.add_row(
                f"{r['block_size']} {r['durability']}",
                title.replace("read, ", ""),
                f"{w['gbps_median']} / {w['gbps_best']}",
                "/".join(str(w.get(f"{k}_gbps_median", "-")) for k in ("raw1", "raw4", "direct4")),
                "/".join(str(w[f"{k}_gbps_median"]) for k in hands) or "-",
                "/".join(str(w[f"ratio_vs_{k}"]) for k in ("raw1", *hands)),
            )
    table.caption = "ratio: median per-round ratio vs raw x1 (and vs hand-written x1 / x2)"
    return table


def mooncake_table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="kvpipe bench: pipeline over MooncakeStore vs the direct client")
    cols = ("block", "data in", "op", "pipeline GB/s", "direct GB/s", "ratio", "vs hand loop")
    for col in cols:
        table.add_column(col, justify="right")
    for r in records:
        w, g = r["write"], r["read"]
        direct = {
            "write": f"put {w['put_from_gbps_median']}, upsert {w['upsert_from_gbps_median']}",
            "read": f"get {g['get_into_gbps_median']}",
        }
        for op, m in (("write", w), ("read", g)):
            table.add_row(
                r["block_size"],
                _WHERE[r["placement"]],
                op,
                f"{m['gbps_median']} / {m['gbps_best']}",
                direct[op],
                str(m["ratio_median"]),
                str(m.get("ratio_vs_loop", "-")),
            )
    return table
