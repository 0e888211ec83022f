"""What another tool's output claims to be, and where its config.json and its tensors disagree.

The claim is read from the output alone: its quantization_config and what its weights are. The findings
are the traps of the public threads: a quantization_config (a stale `weight_block_size`) left in a
checkpoint whose weights are bf16, FP8 weights under a config that declares no quantization, scales left
behind beside bf16 weights, MLP widths config.json does not state, and a claim other than `--to`'s.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from ...model.classify import CONVERTIBLE, PACKED, Classification, Kind
from ...model.family_widths import width_disagreements
from ...source.index import CheckpointIndex

if TYPE_CHECKING:  # the CLI imports CLAIMS from here: no torch before a command needs it
    from .values import Values

COMPANION_SUFFIXES = (
    ".weight_scale_inv",
    ".weight_scale",
    ".weight_scale_2",
    ".input_scale",
    ".activation_scale",
    ".weight_global_scale",
    ".qscale_weight",
    ".qscale_act",
)
FLOAT_DTYPES = {"BF16": "bf16", "F16": "float16", "F32": "float32"}
_SAFETENSORS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# --to: the claim an output of that target makes (ue8m0 is block FP8 at power-of-two scales)
CLAIMS = {
    "bf16": "bf16",
    "float16": "float16",
    "float32": "float32",
    "channel": str(Kind.CHANNEL),
    "block": str(Kind.BLOCK),
    "mxfp8": str(Kind.MXFP8),
    "int8": "int8",
}


def claimed_format(index: CheckpointIndex, classification: Classification) -> str:
    """What the output is, as a reader of its config and tensors sees it: 'bf16', 'block-fp8', 'mixed(...)'."""
    kinds = {str(w.kind) for w in classification.weights.values() if w.kind in CONVERTIBLE | PACKED}
    if kinds:
        return next(iter(kinds)) if len(kinds) == 1 else "mixed(" + "+".join(sorted(kinds)) + ")"
    dtypes = Counter(
        FLOAT_DTYPES[index.entry(n).dtype]
        for n in classification.plain
        if n.endswith(".weight") and len(index.entry(n).shape) >= 2 and index.entry(n).dtype in FLOAT_DTYPES
    )
    return dtypes.most_common(1)[0][0] if dtypes else "empty"  # (a router kept float32 is not the claim)


def target_mismatches(to: str, quantized_in_source: list[Values]) -> list[str]:
    """The output tensors made from quantized source weights that are not what `--to` makes."""
    claim = CLAIMS[to]
    wrong = [f"{v.name} ({v.stored})" for v in quantized_in_source if _made_as(v) != claim]
    if not wrong:
        return []
    shown = ", ".join(wrong[:5]) + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
    return [f"--to {to}: {len(wrong)} weight(s) quantized in the source are not {claim} in the output: {shown}"]


def _made_as(values: Values) -> str | None:
    """What an output tensor is, in CLAIMS' terms: INT8 rows, a float dtype, or its quantized format."""
    if values.int8:
        return CLAIMS["int8"]
    if values.float_dtype:
        return FLOAT_DTYPES.get(_SAFETENSORS.get(values.stored, ""))
    return str(values.fmt.kind) if values.fmt else None


def left_behind(index: CheckpointIndex, classification: Classification) -> list[str]:
    """Scale tensors no quantized weight consumed: beside a float weight, an engine reports them or
    loads them into nothing."""
    found = []
    stray = [
        name
        for w in classification.weights.values()
        if w.kind is Kind.UNQUANTIZED
        for name in (w.scale, *w.companions)
        if name is not None
    ]
    for name in sorted([n for n in classification.plain if n.endswith(COMPANION_SUFFIXES)] + stray):
        module = name.rsplit(".", 1)[0]
        weight = index.locations.get(module + ".weight")
        beside = f" beside a {index.entry(module + '.weight').dtype} weight" if weight else ""
        found.append(f"{name}: a scale left behind{beside}: no quantized weight uses it")
    return found


def config_findings(
    config: dict[str, Any] | None,
    index: CheckpointIndex,
    classification: Classification,
    quantized_elsewise: bool = False,
) -> list[str]:
    """quantized_elsewise: the weights are quantized in a layout the audit reads beside the classifier
    (INT8 rows, int8_rows.py): its quantization_config is not stale."""
    findings = [p.one_line() for p in classification.problems if p.tensor is None]
    quant = (config or {}).get("quantization_config")
    holds = classification.holds_quantized() or quantized_elsewise
    if isinstance(quant, dict) and not holds:
        block = quant.get("weight_block_size")
        what = f", weight_block_size {block}" if block is not None else ""
        findings.append(
            f"config.json: quantization_config (quant_method {quant.get('quant_method')!r}{what}) stays, but no "
            "weight is quantized: engines build FP8 layers for these float weights; remove quantization_config"
        )
    if (
        config is not None
        and quant is None
        and any(index.entry(w.weight).dtype == "F8_E4M3" for w in classification.weights.values())
    ):
        findings.append(
            "config.json declares no quantization_config, yet weights are float8_e4m3fn: engines read their "
            "codes without the scales (an unconverted output)"
        )
    tensors = [(n, s, shard) for n, s, shard in classification.input_shapes(index)]
    for problem in width_disagreements(config, tensors, "config.json and the tensors disagree"):
        findings.append(problem.one_line())
    return findings
