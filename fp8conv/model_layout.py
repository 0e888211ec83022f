"""What tensor names mean in DeepSeek / Kimi / Qwen style checkpoints: Linears, fused groups, MLP widths."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError, OptionsError

FLOAT_DTYPES = ("BF16", "F16", "F32")
# Unquantized in every FP8 release of these families (and by DeepSeek's own recipe): never quantized.
NEVER_QUANTIZED = re.compile(
    r"(embed|norm|lm_head|shared_head\.head|eh_proj|\.mlp\.gate\.weight$|_gate\.weight$|vision|visual|mm_projector)"
)

# Modules an engine fuses into one layer must share one scheme (vLLM: "Found different quantization
# schemes for the shards of ..."). Key: the fused layer, from a weight name.
FUSED_GROUPS = (
    re.compile(r"^(.*\.self_attn\.)(?:q_a_proj|kv_a_proj_with_mqa)\.weight$"),
    re.compile(r"^(.*\.self_attn\.)(?:q_proj|k_proj|v_proj)\.weight$"),
    re.compile(r"^(.*\.mlp\.(?:shared_experts?\.)?)(?:gate_proj|up_proj)\.weight$"),
    re.compile(r"^(.*\.mlp\.experts\.)\d+\.(?:gate_proj|up_proj|down_proj)\.weight$"),
)

# MLP tensors whose intermediate dimension --pad-for-tp pads: (pattern, width key, padded axis from the end)
_MLP = r"^(?:.*\.)?layers\.\d+\.mlp\."
MLP_ROLES = (
    (re.compile(_MLP + r"(?:gate_proj|up_proj)\.weight$"), "intermediate_size", -2),
    (re.compile(_MLP + r"down_proj\.weight$"), "intermediate_size", -1),
    (re.compile(_MLP + r"experts\.\d+\.(?:gate_proj|up_proj)\.weight$"), "moe_intermediate_size", -2),
    (re.compile(_MLP + r"experts\.\d+\.down_proj\.weight$"), "moe_intermediate_size", -1),
    (re.compile(_MLP + r"shared_experts\.(?:gate_proj|up_proj)\.weight$"), "shared_experts", -2),
    (re.compile(_MLP + r"shared_experts\.down_proj\.weight$"), "shared_experts", -1),
    (
        re.compile(_MLP + r"shared_expert\.(?:gate_proj|up_proj)\.weight$"),
        "shared_expert_intermediate_size",
        -2,
    ),
    (re.compile(_MLP + r"shared_expert\.down_proj\.weight$"), "shared_expert_intermediate_size", -1),
)
FUSED_EXPERTS = re.compile(_MLP + r"experts\.(?:gate_up_proj|down_proj)$")


def is_quantizable_linear(name: str, dtype: str, ndim: int) -> bool:
    return name.endswith(".weight") and dtype in FLOAT_DTYPES and ndim in (2, 3) and not NEVER_QUANTIZED.search(name)


def fused_group(name: str) -> str | None:
    for pattern in FUSED_GROUPS:
        m = pattern.match(name)
        if m:
            return m.group(1) + f"<{pattern.pattern}>"
    return None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) and "hidden_size" in nested else config


def mlp_widths(config: dict[str, Any] | None) -> dict[str, int]:
    """Each intermediate width the MLP tensors use, by role."""
    c = text_config(config or {})
    widths = {k: c.get(k) for k in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")}
    widths = {k: v for k, v in widths.items() if isinstance(v, int) and v > 0}
    n_shared = c.get("n_shared_experts")
    if "moe_intermediate_size" in widths and isinstance(n_shared, int) and n_shared > 0:
        widths["shared_experts"] = widths["moe_intermediate_size"] * n_shared
    return widths


@dataclass(frozen=True)
class MlpPadding:
    """Old and new width per role, for --pad-for-tp."""

    widths: dict[str, int]
    padded: dict[str, int]

    def padded_shape(self, name: str, shape: tuple[int, ...], shard: str) -> tuple[int, ...] | None:
        for pattern, role, axis in MLP_ROLES:
            if not pattern.match(name) or role not in self.widths:
                continue
            if shape[axis] != self.widths[role]:
                raise CheckpointError(
                    f"has {shape[axis]} along its intermediate dimension but config.json implies "
                    f"{self.widths[role]} ({role})",
                    tensor=name,
                    shard=shard,
                    fix="config.json and the tensors disagree; --pad-for-tp needs them to agree",
                )
            if self.padded[role] == shape[axis]:
                return None
            new = list(shape)
            new[axis] = self.padded[role]
            return tuple(new)
        if FUSED_EXPERTS.match(name):
            raise OptionsError(
                "--pad-for-tp does not support fused 3-D expert tensors yet",
                fix="convert without --pad-for-tp",
            )
        return None


def plan_mlp_padding(config: dict[str, Any] | None, tp: int, block: tuple[int, int]) -> MlpPadding:
    """Pad each width to a multiple of tp * lcm(bn, bk): every rank then holds whole blocks of gate/up
    rows (block_n) and of down columns (block_k)."""
    widths = mlp_widths(config)
    if not widths:
        raise OptionsError(
            "--pad-for-tp needs intermediate_size / moe_intermediate_size in config.json",
            fix="add them to config.json, or convert without --pad-for-tp",
        )
    unit = tp * math.lcm(*block)
    padded = {role: -(-w // unit) * unit for role, w in widths.items()}
    if "shared_experts" in padded:  # engines build shared experts as moe_intermediate_size * n_shared
        padded["shared_experts"] = padded["moe_intermediate_size"] * (
            widths["shared_experts"] // widths["moe_intermediate_size"]
        )
    return MlpPadding(widths, padded)


def updated_widths_config(config: dict[str, Any], padding: MlpPadding) -> None:
    """Write the padded widths back into the (text) config, in place."""
    c = text_config(config)
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if key in padding.padded and key in c:
            c[key] = padding.padded[key]


def tp_report(
    config: dict[str, Any] | None, block: tuple[int, int], tps: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
) -> dict[str, list[str]]:
    """For each TP size, the MLP widths whose per-rank slice is not whole blocks, as vLLM's
    validate_fp8_block_shape checks them: gate/up rows (merged, column-parallel) by block_n at any TP,
    down columns (row-parallel) by block_k once split across ranks."""
    widths = mlp_widths(config)
    report: dict[str, list[str]] = {}
    for tp in tps:
        bad = []
        for role, w in widths.items():
            per_rank = w / tp
            whole = w % tp == 0 and (w // tp) % block[0] == 0 and (tp == 1 or (w // tp) % block[1] == 0)
            if not whole:
                bad.append(f"{role} {w} -> {per_rank:g}/rank")
        report[str(tp)] = bad
    return report
