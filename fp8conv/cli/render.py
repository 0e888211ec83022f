"""What the commands print: inspect's report, a dry run's plan, a conversion's summary (text only;
the commands echo it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..check.inspect_report import InspectReport
from ..options import DEFAULT_BLOCK

if TYPE_CHECKING:
    from ..check.audit.audit import AuditResult
    from ..run.convert import ConvertResult
    from ..run.dry_run import PlanSummary

PARTIAL_LINES = 12  # a real checkpoint has hundreds; --json has them all


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def render_report(r: InspectReport) -> str:
    block = f"{r.block_size[0]}x{r.block_size[1]} (from {r.block_size_from})" if r.block_size else "none"
    if r.mxfp8_groups:  # MXFP8 has scale groups, not blocks: "none" alone would read as unquantized
        groups = ", ".join(f"{g[0]}x{g[1]}" for g in r.mxfp8_groups)
        mx = f"{groups} groups (MXFP8: one E8M0 scale per {r.mxfp8_groups[0][1]} values of a row)"
        block = f"{block}; MXFP8 weights in {mx}" if r.block_size else mx
    lines = [
        f"checkpoint:    {r.source}",
        f"format:        {r.format}",
        f"quant_method:  {r.quant_method or 'none'}",
        f"block size:    {block}",
        f"shards:        {r.shards}   tensors: {r.tensors}   size: {gib(r.total_bytes)} ({r.total_bytes} bytes)",
        "formats:       " + ", ".join(f"{k} {v}" for k, v in r.formats.items()),
        "dtypes:        " + ", ".join(f"{k} {v}" for k, v in r.dtypes.items()),
        "output size:   " + ", ".join(f"--to {k} ~{gib(v)}" for k, v in r.estimated_output_bytes.items()),
    ]
    mtp = ", ".join([str(i) for i in r.mtp_layers] + r.mtp_modules) or "none"
    lines.append(
        f"MTP layers:    {mtp}" + (f" (num_hidden_layers = {r.num_hidden_layers})" if r.num_hidden_layers else "")
    )
    if r.block_geometries:  # a tensor's grid confirms its own block (model.geometry)
        each = ", ".join(f"{g} {n} tensor(s)" for g, n in r.block_geometries.items())
        lines.append(f"block geometries: {each}")
    for layout, n in r.chunked_layouts.items():
        lines.append(f"chunked rows:  {n} tensor(s): {layout}")
    lines.append(f"partial blocks: {len(r.partial_block_tensors)} tensor(s)")
    for t in r.partial_block_tensors[:PARTIAL_LINES]:
        lines.append(f"  {t.name} {t.shape} -> grid {t.grid} of {t.block[0]}x{t.block[1]} blocks")
    if len(r.partial_block_tensors) > PARTIAL_LINES:
        lines.append(f"  ... and {len(r.partial_block_tensors) - PARTIAL_LINES} more (--json lists them all)")
    block = f"{r.block_size[0]}x{r.block_size[1]}" if r.block_size else "{}x{}".format(*DEFAULT_BLOCK)
    if r.tp_indivisible:
        lines.append(f"tensor parallel: MLP widths that do not split into whole {block} blocks per rank")
    else:  # no config.json (Mistral-native files): no width is known, so none is called ok
        lines.append("tensor parallel: not checked: no config.json states this checkpoint's MLP widths")
    for tp, bad in r.tp_indivisible.items():
        lines.append(f"  TP={tp:<3} " + ("ok" if not bad else "not divisible: " + "; ".join(bad)))
        for roles, size in r.padded_output_bytes.get(tp, {}).items():
            lines.append(f"          --pad-for-tp {tp} --pad-roles {roles}: --to block ~{gib(size)}")
    if any(r.tp_indivisible.values()) and r.padded_output_bytes:
        lines.append("  (convert --to block --pad-for-tp N [--pad-roles ...] zero-pads the MLP widths to fix this)")
    elif any(r.tp_indivisible.values()):  # no padded plan could be made: convert refuses --pad-for-tp too
        why = "convert --to block --pad-for-tp N --dry-run says why"
        lines.append(f"  (--pad-for-tp cannot pad this checkpoint: {why})")
    if r.deepgemm_ready is not None:
        lines.append(f"DeepGEMM-ready: {r.deepgemm_ready}")
    if r.not_converted_unmatched:
        lines.append(
            f"not converted: {r.not_converted_entries} entries listed, "
            f"{len(r.not_converted_unmatched)} match no tensor:"
        )
        lines += [f"  {e}" for e in r.not_converted_unmatched[:PARTIAL_LINES]]
        if len(r.not_converted_unmatched) > PARTIAL_LINES:
            lines.append(f"  ... and {len(r.not_converted_unmatched) - PARTIAL_LINES} more (--json lists them all)")
    read = "" if r.scales_read else " (from the headers; --scales reads the scale tensors too)"
    lines.append(f"problems:      {len(r.problems) or 'none'}{read}")
    lines += [f"  {p}" for p in r.problems]
    lines += [f"warning: {w}" for w in r.warnings]
    return "\n".join(lines)


def strategy_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in counts.items()) or "no jobs"


def render_plan(p: PlanSummary) -> str:
    converted = [s for s in p.shards if s.state == "convert"]
    lines = [
        f"plan for {p.output} (--to {p.target}), nothing written (--dry-run): {len(converted)} shard(s) to write, "
        f"{p.tensors} tensor(s), {gib(p.nbytes)} ({p.nbytes} bytes)"
    ]
    width = max((len(s.name) for s in p.shards), default=0)
    for s in p.shards:
        where = f"  part {s.part}" if s.part is not None else ""
        state = "" if s.state == "convert" else f"  ({s.state}, not written by this run)"
        jobs = strategy_text(s.strategies)
        lines.append(f"  {s.name:<{width}}  {s.tensors} tensor(s)  {gib(s.nbytes)}  {jobs}{where}{state}")
    lines.append(f"jobs by strategy: {strategy_text(p.strategies)}")
    memory = [f"~{gib(p.process_bytes)} for the process", f"~{gib(p.writer_bytes)} for the writer's buffers"]
    if p.band_bytes:
        memory.append(f"~{gib(p.band_bytes)} of bands of {p.band_elements} elements")
    if p.largest_held:
        name, why, nbytes = p.largest_held
        memory.append(f"~{gib(nbytes)} for {name}, which {why}")
    cap = f"; --max-memory {gib(p.max_memory)}" if p.max_memory else ""
    lines.append("memory (what --max-memory is checked against, not a peak): " + ", ".join(memory) + cap)
    last = [name for name, yes in (("config.json", p.writes_config), ("the index", p.writes_index)) if yes]
    lines.append(
        f"other files: {len(p.files_copied)} copied, {len(p.files_rewritten)} rewritten, "
        f"{len(p.files_skipped)} not copied" + (f"; {' and '.join(last)} written last" if last else "")
    )
    lines.append("not checked by --dry-run: " + "; ".join(p.not_checked))
    return "\n".join(lines)


def convert_summary(result: ConvertResult) -> str:
    """What this process did: a part reports its own shards, tensors, bytes and rate, not the run's."""
    rate = result.bytes_written / max(result.seconds, 1e-9) / 2**20
    kept = f" ({len(result.shards_kept)} kept from an earlier run)" if result.shards_kept else ""
    work = (
        f"{len(result.shards)} shard(s){kept}, {result.tensors_converted} tensor(s) converted, "
        f"{result.tensors_copied} copied"
    )
    written = f"{gib(result.bytes_written)} written in {result.seconds:.1f} s ({rate:.0f} MiB/s)"
    total = result.packed_blocks_total
    if total and result.packed_blocks_exact == total:  # (some lost: a warning says how many)
        written += f"; all {total} blocks requantized from 4-bit values or power-of-two scales exact"
    if result.part is None:
        return f"wrote {result.output}: {work}, {len(result.files_copied)} other file(s) copied, {written}"
    i, n = result.part
    state = "all parts done, finalized" if result.finalized else "other parts unfinished; the last to finish finalizes"
    return f"wrote part {i}/{n} of {result.output}: {work}, {written}; {state}"


LISTED = 20  # missing / extra tensors printed by name; the rest counted (--json lists them all)


def render_audit(report: AuditResult) -> str:
    """verify of another tool's output: each tensor that is not right, what is missing or extra, the
    findings, then the summary line (--json has every tensor's verdict)."""
    lines = [tensor.line() for tensor in report.tensors if not tensor.ok]
    for what, names in (("missing", report.missing), ("extra", report.extra)):
        lines += [f"{what:<11} {name}" for name in names[:LISTED]]
        if len(names) > LISTED:
            lines.append(f"{what:<11} ... and {len(names) - LISTED} more")
    lines += [f"finding     {finding}" for finding in report.findings]
    lines += [f"note        {note}" for note in report.notes]
    return "\n".join([*lines, report.summary()])
