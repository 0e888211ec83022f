"""Mistral-native releases (Mistral-Large-3, Medium-3.5): `consolidated*.safetensors` + `params.json`,
tensors `layers.{L}.attention.wq_a.weight` with per-tensor `.qscale_weight` (a multiplier: vLLM's
MistralLarge3ForCausalLM maps it to `.weight_scale`) and `.qscale_act` (`.input_scale`).

When a release ships only those, they are the checkpoint: converted in their own names, one output file
per input file, `params.json` rewritten (fp8conv.config.rewrite_mistral_params: its `quantization`
removed for bf16), which vLLM loads with `--load-format mistral --config-format mistral`. FP8 targets are
refused: vLLM's Mistral reader matches a compressed-tensors `ignore` list against its own module names,
which these names are not, and it has no spelling for block FP8. When HF shards are present too, they
are the checkpoint and the consolidated files are skipped, as before.
"""

from __future__ import annotations

import re

from .config import MISTRAL_PARAMS_NAME
from .errors import CheckpointError

NATIVE_PREFIX = "consolidated"
NATIVE_SCALE_SUFFIX = ".qscale_weight"
NATIVE_ACTIVATION_SUFFIX = ".qscale_act"
# attention / KV-cache scales of Mistral's fake quantizers (vLLM: kv_scale, attn.q_scale, k_scale, v_scale)
FAKE_QUANTIZER = re.compile(r"\.(?:kv|q|k|v)_fake_quantizer\.qscale_act$")


def is_native(name: str) -> bool:
    return name.startswith(NATIVE_PREFIX) and name.endswith(".safetensors")


def hf_shards_first(top_level: list[str]) -> list[str]:
    """The top-level .safetensors that are the checkpoint: the HF-named ones when there are any (the
    consolidated files are then Mistral's second copy of the same weights), else the consolidated ones."""
    hf = [name for name in top_level if not is_native(name)]
    return hf or top_level


def native_only(shard_names: list[str], has_config: bool, other_files: list[str]) -> bool:
    """A release of consolidated files and params.json only, with no HF shard and no config.json."""
    return (
        bool(shard_names)
        and not has_config
        and MISTRAL_PARAMS_NAME in other_files
        and all(is_native(n) for n in shard_names)
    )


def native_problems(shard: str, first_fp8: str | None, to: str) -> list[CheckpointError]:
    """FP8 targets of a Mistral-native-only release: refused, naming the file and the reason."""
    if to == "bf16":
        return []
    return [
        CheckpointError(
            f"is a Mistral-native release (consolidated files + params.json, no config.json); fp8conv writes "
            f"it in its own names, where vLLM's Mistral reader has no block FP8 spelling and matches a "
            f"compressed-tensors ignore list against other names, so --to {to} would not load as written",
            tensor=first_fp8,
            shard=shard,
            fix="convert with --to bf16 (params.json's quantization removed), or use the release's HF-format files",
        )
    ]


def fake_quantizer_warning(names: list[str]) -> str:
    return (
        f"{len(names)} Mistral fake-quantizer activation / KV-cache scale(s) ({names[0]}, ...) dropped: "
        "the bf16 output has no quantization for them to apply to"
    )
