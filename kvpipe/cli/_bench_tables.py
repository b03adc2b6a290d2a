"""The file-store and Mooncake tables of ``kvpipe bench``: markdown for the docs, rich tables
for the terminal."""

from __future__ import annotations

from typing import Any, Final

from rich.table import Table

__all__ = ("file_markdown", "file_table", "mooncake_markdown", "mooncake_table")

_WHERE: Final = {"local": "this process", "remote": "another process"}


def file_markdown(records: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for rec_kind in ("write", "read"):
        lines += [
            f"| block | durability | {rec_kind} | pipeline GB/s (median / best) | "
            "raw x1 GB/s | raw x4 GB/s | O_DIRECT x4 GB/s | ratio (median) | "
            "vs page-cache raw |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in records:
            w = r[rec_kind]
            kind = rec_kind + (" (cold)" if rec_kind == "read" and r["cold_reads"] else "")
            lines.append(
                f"| {r['block_size']} | {r['durability']} | {kind} | "
                f"{w['gbps_median']} / {w['gbps_best']} | {w['raw1_gbps_median']} | "
                f"{w['raw4_gbps_median']} | {w.get('direct4_gbps_median', '-')} | "
                f"**{w['ratio_median']}** | {w.get('ratio_vs_buffered', '-')} |"
            )
        lines.append("")
    if all("slice_block_num" in r for r in records):
        slices = ", ".join(f"{r['block_size']}: {r['slice_block_num']}" for r in records)
        lines += [
            f"Pipeline: requests of {records[0]['request_blocks']} blocks, all in flight at "
            f"once; slices of {slices} blocks; file store threads={records[0]['store_threads']}; "
            "checksums on.",
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
    table = Table(title="kvpipe bench: pipeline over the file store vs raw files")
    cols = ("block", "op", "pipeline GB/s", "raw x1 / x4 / direct x4", "ratio", "vs x1/x4")
    for col in cols:
        table.add_column(col, justify="right")
    for r in records:
        for op in ("write", "read"):
            w = r[op]
            table.add_row(
                r["block_size"],
                op,
                f"{w['gbps_median']} / {w['gbps_best']}",
                f"{w['raw1_gbps_median']} / {w['raw4_gbps_median']} / "
                f"{w.get('direct4_gbps_median', '-')}",
                str(w["ratio_median"]),
                str(w.get("ratio_vs_buffered", "-")),
            )
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
