"""Markdown and terminal tables of the issue-7 scenarios (memory, sweeps, scaling, lag,
overhead), of the FastDeploy adapter's (integration) and of the embedded-server scenario
(server), and the generated sections of
``docs/performance.md``.

A generated section sits between ``<!-- kvpipe-bench:NAME -->`` and
``<!-- /kvpipe-bench:NAME -->``; :func:`update_doc` replaces what is between them and leaves
the rest of the document (the prose around the tables) alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final

from rich.table import Table

__all__ = ("NEW_SCENARIOS", "markdown", "tables", "update_doc")

#: The scenarios this module renders, in suite order.
NEW_SCENARIOS: Final = (
    "memory",
    "sweeps",
    "scaling",
    "lag",
    "overhead",
    "integration",
    "server",
    "device",
)


def _md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
        "",
    ]


def _memory(records: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]], list[str]]:
    header = [
        "block",
        "op",
        "pipeline GB/s (median / best)",
        "no checksums GB/s",
        "plain x1 GB/s",
        "plain x2 GB/s",
        "ratio (median)",
        "ratio, no checksums",
    ]
    rows = []
    for r in records:
        for op in ("write", "read"):
            m = r[op]
            rows.append(
                [
                    r["block_size"],
                    op,
                    f"{m['gbps_median']} / {m['gbps_best']}",
                    m["nocheck_gbps_median"],
                    m["plain1_gbps_median"],
                    m["plain2_gbps_median"],
                    f"**{m['ratio_median']}**",
                    m["nocheck_ratio_median"],
                ]
            )
    shapes = ", ".join(
        f"{r['block_size']}: requests of {r['pipeline']['request_blocks']} blocks in slices of "
        f"{r['pipeline']['slice_block_num']}"
        for r in records
    )
    note = [
        f"Pipeline: {records[0]['pipeline']['concurrency']} requests in flight; {shapes}; "
        f"{records[0]['blocks'] * records[0]['block_bytes'] >> 20} MiB per round, "
        f"{records[0]['write']['rounds']} interleaved rounds after a warm-up. Ratio: median "
        "over rounds of pipeline / the faster plain contender of that round.",
        "",
    ]
    return header, rows, note


_SWEEP_TITLES: Final = {
    "slice_block_num": "2 MiB blocks, requests of 64 blocks, 2 in flight",
    "block_size": "requests of 32 MiB in slices of 8 MiB, 4 in flight",
    "concurrency": "2 MiB blocks, requests of 4 blocks in one slice",
}


def _sweeps(records: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for sweep in dict.fromkeys(r["sweep"] for r in records):
        recs = [r for r in records if r["sweep"] == sweep]
        plain = "ratio_median" in recs[0]["write"]
        header = [sweep, "write GB/s", "write p50 / p99 ms", "read GB/s", "read p50 / p99 ms"]
        if plain:
            header += ["write / plain", "read / plain"]
        rows = []
        for r in recs:
            w, g = r["write"], r["read"]
            row = [
                r["x"],
                w["gbps_median"],
                f"{w['latency_ms']['p50']:.1f} / {w['latency_ms']['p99']:.1f}",
                g["gbps_median"],
                f"{g['latency_ms']['p50']:.1f} / {g['latency_ms']['p99']:.1f}",
            ]
            if plain:
                row += [w["ratio_median"], g["ratio_median"]]
            rows.append(row)
        n = recs[0]["blocks"] * recs[0]["block_bytes"] >> 20
        lines += [
            f"**{sweep}** ({_SWEEP_TITLES.get(sweep, '')}; {n} MiB per round, "
            f"{recs[0]['rounds']} rounds, latencies over {recs[0]['write']['latency_ms']['n']} "
            "requests per point):",
            "",
            *_md_table(header, rows),
        ]
    return lines


def _scaling(result: dict[str, Any]) -> tuple[list[str], list[list[Any]], list[str]]:
    header = [
        "workload",
        "blocks (GiB)",
        "write s",
        "read s",
        "write time / linear",
        "read time / linear",
        "pipeline peak MiB",
        "peak vs 1x",
        "sampled peak MiB",
        "rss before MiB",
    ]
    rows = [
        [
            f"{p['factor']}x",
            f"{p['blocks']} ({p['gib']})",
            p["write_seconds"],
            p["read_seconds"],
            p["time_vs_linear"]["write"],
            p["time_vs_linear"]["read"],
            p["pipeline_peak_mib"],
            f"**{p['peak_vs_1x']}**",
            p["sampled_peak_mib"],
            p["rss_before_mib"],
        ]
        for p in result["points"]
    ]
    c = result["config"]
    note = [
        f"2 MiB blocks; requests of {c['request_blocks']} blocks in slices of "
        f"{c['slice_block_num']}, {c['concurrency']} in flight; staging "
        f"{c['staging_bytes'] >> 20} MiB; a cache of {c['base_blocks']} blocks in every "
        f"process; {result['rounds']} interleaved rounds, one process per size and round; "
        f"pipeline peak from {result['points'][0]['peak_source']}.",
        "",
    ]
    return header, rows, note


def _lag(records: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]], list[str]]:
    header = ["phase", "loop", "threads", "lag p50 ms", "lag p99 ms", "lag max ms", "ticks", "GB/s"]
    rows = [
        [
            r["phase"],
            r["loop"],
            "{copy},{io},{file_store}".format(**r["threads"]),
            r["lag_ms"]["p50"],
            f"**{r['lag_ms']['p99']}**",
            f"**{r['lag_ms']['max']}**",
            r["lag_ms"]["n"],
            r.get("gbps", "-"),
        ]
        for r in records
    ]
    return header, rows, []


def _op_rows(result: dict[str, Any], baseline: str) -> list[list[Any]]:
    """A write row and a read row: GB/s of the contender and of ``baseline``, and the ratio."""
    return [
        [
            op,
            f"{result[op]['gbps_median']} / {result[op]['gbps_best']}",
            f"{result[op][f'{baseline}_gbps_median']} / {result[op][f'{baseline}_gbps_best']}",
            f"**{result[op]['ratio_median']}**",
        ]
        for op in ("write", "read")
    ]


def _integration(result: dict[str, Any]) -> tuple[list[str], list[list[Any]], list[str]]:
    header = ["op", "adapter GB/s (median / best)", "direct GB/s (median / best)", "ratio"]
    rows = _op_rows(result, "direct")
    hop = result["hop_us"]
    note = [
        f"KVPipeAttentionStore (per-layer Paddle CPU tensors) from {result['threads']} threads "
        f"vs the pipeline on its own loop with {result['threads']} tasks; {result['store']} "
        f"store, {result['block_size']} blocks, requests of {result['request_blocks']} blocks, "
        f"{result['blocks'] * result['block_bytes'] >> 20} MiB per round, "
        f"{result['write']['rounds']} interleaved rounds after a warm-up. Ratio: median over "
        "rounds of adapter / direct.",
        "",
        f"Thread hop (a no-op through the adapter's portal, {result['threads']} threads at "
        f"once, {hop['calls']} calls): **p50 {hop['p50']} µs, p99 {hop['p99']} µs** "
        f"(mean {hop['mean']} µs).",
    ]
    return header, rows, note


def _device(result: dict[str, Any]) -> tuple[list[str], list[list[Any]], list[str]]:
    header = ["op", "pipeline GB/s (median / best)", "plain GB/s (median / best)", "ratio"]
    rows = _op_rows(result, "plain")
    link, host = result["link_gbps"], result["host_gbps"]
    note = [
        f"{result['device']}, copy path `{result['device_path']}`: "
        f"{result['blocks']} blocks of {result['block_size']} per round (Llama-3-8B layout, "
        f"64 tensors) written from a device cache to the memory store and read back into other "
        f"blocks; requests of {result['request_blocks']} blocks in slices of "
        f"{result['slice_blocks']}, {result['concurrency']} in flight, {result['threads']} copy "
        f"threads; plain: {result['threads']} threads, one DMA per tensor per slice. "
        f"{result['write']['rounds']} interleaved rounds after a warm-up; ratio: median over "
        "rounds of pipeline / plain.",
        "",
        f"The link alone (one contiguous `cuMemcpyAsync` per slice, pinned host memory, no "
        f"host copy): **{link['d2h']} GB/s device to host, {link['h2d']} GB/s host to device**.",
        "",
        f"The host alone ({result['threads']} threads, no device: each stored value copied "
        f"into pinned memory, then also hashed where it landed, as a verified read's host "
        f"passes): **{host['copy']} GB/s copied, {host['copy_hash']} GB/s copied and hashed**.",
    ]
    return header, rows, note


def _server(records: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]], list[str]]:
    header = [
        "store",
        "phase",
        "latency p50 ms",
        "latency p99 ms",
        "latency max ms",
        "requests",
        "offload GB/s",
        "p99 / hand",
        "GB/s / hand",
    ]
    rows = []
    for r in records:
        for phase, s in r["summary"].items():
            ours = phase == "kvpipe"
            rows.append(
                [
                    r["store"],
                    phase,
                    s["p50_ms"],
                    f"**{s['p99_ms']}**",
                    s["max_ms"],
                    s["requests"],
                    s.get("gbps", "-"),
                    f"**{r['p99_ratio']}**" if ours else "-",
                    f"**{r['gbps_ratio']}**" if ours else "-",
                ]
            )
    c = records[0]["config"]
    r0 = records[0]
    note = [
        f"uvicorn ({r0['http']}) on {r0['loop']}, a plain ASGI app answering "
        f"{c['rate']:g} GET/s from another process over {c['connections']} keep-alive "
        "connections (open loop: latency from the scheduled send time). Per phase "
        f"{c['passes']} passes of writing and reading back {r0['blocks']} blocks of 2 MiB "
        f"({r0['bytes_per_phase'] >> 20} MiB moved); kvpipe: requests of {c['per_request']} "
        f"blocks in slices of {c['slice_block_num']}, {c['concurrency']} in flight, checksums "
        f"on; hand: numpy gather/scatter in {c['hand_threads']} worker threads. Latencies and "
        "GB/s: medians over "
        f"{len([x for x in r0['rounds'] if x['phase'] == 'idle'])} interleaved rounds after a "
        "warm-up (max: the largest); ratios: median over rounds of kvpipe / hand.",
        "",
    ]
    return header, rows, note


def _overhead(result: dict[str, Any]) -> list[str]:
    fixed = result["fixed_us"]
    rows = []
    for who in ("pipeline", "plain", "one_hop", "actors", "one_hop_floor"):
        if who not in fixed:  # a result from before the one-hop contender
            continue
        for op in ("write", "read"):
            f = fixed[who][op]
            rows.append([who, op, f["request"], f["slice"], f["block"]])
    ref = result["reference"]
    per = [
        [
            p["slice_block_num"],
            p["write_us"],
            f"**{p['write_pct']}**",
            p["read_us"],
            f"**{p['read_pct']}**",
            p["write_with_threads_pct"],
            p["read_with_threads_pct"],
        ]
        for p in result["per_2mib_block"]
    ]
    return [
        "Fixed costs (µs), tiny blocks, one request at a time, medians of "
        f"{result['rounds']} rounds; `actors` = pipeline - plain loop; `one_hop_floor` = "
        "one_hop - plain loop, the least an actor design on anyio adds (one memory-stream "
        "hop and one deadline scope per slice):",
        "",
        *_md_table(["contender", "op", "per request", "per slice", "per block"], rows),
        f"Reference: gathering one 2 MiB block (64 segments) takes {ref['gather_2mib_us']} µs "
        f"(memcpy of 2 MiB: {ref['memcpy_2mib_us']} µs); a worker-thread call "
        f"{ref['thread_hop_us']} µs (the pipeline makes {ref['thread_hops_per_slice']} per "
        "slice larger than 256 KiB on each path).",
        "",
        "Actor overhead per 2 MiB block, requests of 64 blocks, as % of its gather time:",
        "",
        *_md_table(
            [
                "slice_block_num",
                "write µs",
                "write %",
                "read µs",
                "read %",
                "write % with thread calls",
                "read % with thread calls",
            ],
            per,
        ),
    ]


def markdown(results: dict[str, Any], scenario: str) -> str:
    """The generated section of one scenario (without markers)."""
    data = results[scenario]
    others = results.get("others_cpu_pct", {}).get(scenario)
    busy = f" Other processes used {others} % of the cores meanwhile." if others is not None else ""
    lines = [
        f"Measured {results['when']} on {results['machine']} in "
        f"{results['seconds'][scenario]} s; `{results['command']}`.{busy}",
        "",
    ]
    if scenario == "memory":
        header, rows, note = _memory(data)
        lines += [*_md_table(header, rows), *note]
    elif scenario == "sweeps":
        lines += _sweeps(data)
    elif scenario == "scaling":
        header, rows, note = _scaling(data)
        lines += [*_md_table(header, rows), *note]
    elif scenario == "lag":
        header, rows, _ = _lag(data)
        lines += _md_table(header, rows)
    elif scenario == "overhead":
        lines += _overhead(data)
    elif scenario == "integration":
        header, rows, note = _integration(data)
        lines += [*_md_table(header, rows), *note]
    elif scenario == "server":
        header, rows, note = _server(data)
        lines += [*_md_table(header, rows), *note]
    elif scenario == "device":
        header, rows, note = _device(data)
        lines += [*_md_table(header, rows), *note]
    if results.get("plots", {}).get(scenario):
        lines += [f"![{scenario}](img/{name})" for name in results["plots"][scenario]] + [""]
    return "\n".join(lines).rstrip() + "\n"


def _rich(title: str, header: list[str], rows: list[list[Any]]) -> Table:
    table = Table(title=title)
    for col in header:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*(str(c).replace("**", "") for c in row))
    return table


def tables(results: dict[str, Any], scenario: str) -> list[Table]:
    """Terminal tables of one scenario."""
    data = results[scenario]
    builders: dict[str, Callable[[Any], tuple[list[str], list[list[Any]], list[str]]]] = {
        "memory": _memory,
        "scaling": _scaling,
        "lag": _lag,
        "integration": _integration,
        "server": _server,
        "device": _device,
    }
    if scenario in builders:
        header, rows, _ = builders[scenario](data)
        return [_rich(f"kvpipe bench: {scenario}", header, rows)]
    # sweeps and overhead: one table per markdown table
    text = markdown(results, scenario)
    out = []
    for block in re.split(r"\n\n+", text):
        lines = [ln for ln in block.splitlines() if ln.startswith("|")]
        if len(lines) < 3:
            continue
        cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
        out.append(_rich(f"kvpipe bench: {scenario}", cells[0], cells[2:]))
    return out


def update_doc(text: str, results: dict[str, Any]) -> tuple[str, list[str]]:
    """Replace the generated section of every scenario in ``results`` that ``text`` has
    markers for; returns the new text and the scenarios whose markers were missing."""
    missing = []
    for scenario in NEW_SCENARIOS:
        if not results.get(scenario):
            continue
        begin, end = f"<!-- kvpipe-bench:{scenario} -->", f"<!-- /kvpipe-bench:{scenario} -->"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        if not pattern.search(text):
            missing.append(scenario)
            continue
        section = f"{begin}\n{markdown(results, scenario)}{end}"
        match = pattern.search(text)
        assert match is not None
        text = text[: match.start()] + section + text[match.end() :]
    return text, missing
