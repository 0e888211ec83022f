"""AMD Quark exports (`quant_method: "quark"`), as vLLM's (quantization/quark/quark.py), sglang's and Quark's
own readers (quark/torch/export: QConfig.from_dict, get_layer_quant_config) read them.

- Sections: `global_quant_config`; `layer_quant_config` {module pattern: config}, the first key matching a
  module wins (fnmatch when the key has `*`, else the module must be part of the key: vLLM's rule since
  vllm#24239); `layer_type_quant_config` {class name: config} (Quark and transformers read it; vLLM does
  not); `exclude` (modules left unquantized; vLLM: an exact name or `re:`, Quark: fnmatch, `X` also
  covering `X.*`: fp8conv's ignore list reads both). A config whose sections sit under `quant_config`
  (with `json_export_config`: transformers' QuarkConfig written back, seen in test fixtures, inferred) is
  read the same.
- A layer config's `weight` (a dict, or a list for two-stage schemes) says what its tensors are; fp8conv
  reads: `fp8_e4m3` per_tensor (`weight_scale` 0-D), per_channel (`weight_scale` [N]) and per_block
  (`block_size` [bn, bk], `weight_scale` [ceil(N/bn), ceil(K/bk)], a multiplier as DeepSeek's
  weight_scale_inv; float32 or E8M0 by scale_type), fp8 per_group of 32 with E8M0 scales (MXFP8), and
  `fp4` per_group of 32 with E8M0 scales (MXFP4: uint8 `weight` [N, K/2] low nibble first, `weight_scale`
  uint8 [N, K/32]); `pack_method: reorder` changes only int4 packing, which is refused. Anything else the
  config names (MXFP6 fp6_e3m2 / fp6_e2m3, int8, int4, NVFP4's two-stage fp4, fp8_e5m2, asymmetric) is
  refused by name with the section that names it.
- Activations: `input_tensors` dynamic, or static with `input_scale`. KV cache: `export.kv_cache_group`
  (`k_proj.output_scale` / `v_proj.output_scale`, kv_scales.py).
"""

from __future__ import annotations

from typing import Any

from ...errors import CheckpointError
from ..quant_settings import MXFP4_GROUP, MXFP8_GROUP, ModuleScheme, QuantSettings, parse_block_size

SECTIONS = ("global_quant_config", "layer_quant_config", "layer_type_quant_config", "exclude")
_FP8 = "fp8_e4m3"
_NOT_DECODED = {
    "fp6_e3m2": "MXFP6",
    "fp6_e2m3": "MXFP6",
    "int8": "INT8",
    "uint8": "UINT8",
    "int4": "INT4",
    "uint4": "UINT4",
    "fp8_e5m2": "e5m2 FP8",
    "mx": "MX with another element type",
}


def read(q: dict[str, Any], config: dict[str, Any], s: QuantSettings) -> None:
    q = _sections(q)
    configs: list[tuple[str, Any]] = [("global_quant_config", q.get("global_quant_config"))]
    layers = q.get("layer_quant_config") or {}
    types = q.get("layer_type_quant_config") or {}
    if not isinstance(layers, dict) or not isinstance(types, dict):
        s.refuse("Quark layer_quant_config / layer_type_quant_config is not an object", fix="fix config.json")
        return
    configs += [(f"layer_quant_config[{k!r}]", v) for k, v in layers.items()]
    configs += [(f"layer_type_quant_config[{k!r}]", v) for k, v in types.items()]
    blocks: dict[str, tuple[int, int]] = {}
    for where, layer in configs:
        if layer is None:
            continue
        if not isinstance(layer, dict):
            s.refuse(f"Quark {where} is not an object", fix="fix config.json")
            continue
        block = _weight(layer.get("weight"), where, s)
        if block is not None:
            blocks[where] = block
        _activations(layer.get("input_tensors"), s)
    _blocks(blocks, layers, s)
    exclude = q.get("exclude") or []
    if not isinstance(exclude, list):
        s.refuse("Quark exclude is not a list", fix="fix config.json")
        return
    s.not_converted += [str(m) for m in exclude]


def _sections(q: dict[str, Any]) -> dict[str, Any]:
    """The sections at the top (Quark's export), or under quant_config (transformers' QuarkConfig)."""
    nested = q.get("quant_config")
    if "global_quant_config" not in q and isinstance(nested, dict):
        return nested
    return q


def _weight(spec: Any, where: str, s: QuantSettings) -> tuple[int, int] | None:
    """Record what one layer config's weight spec declares; its block size when per_block."""
    if spec is None:
        return None
    if isinstance(spec, list):  # two-stage schemes (NVFP4: fp4 per 16, then an fp8 per-tensor scale)
        dtypes = [str(x.get("dtype")) if isinstance(x, dict) else "?" for x in spec]
        s.refuse(
            f"Quark {where}.weight is a two-stage scheme ({' then '.join(dtypes)}); fp8conv does not decode it",
            fix="fp8conv reads Quark FP8 (per tensor, channel, block, MXFP8) and MXFP4 weights",
        )
        return None
    if not isinstance(spec, dict):
        s.refuse(f"Quark {where}.weight is not an object", fix="fix config.json")
        return None
    dtype, scheme = str(spec.get("dtype")), str(spec.get("qscheme"))
    if spec.get("symmetric") is False:
        s.refuse(
            f"Quark {where}.weight is asymmetric {dtype} (zero points); fp8conv decodes symmetric weights only",
            fix="fp8conv reads Quark FP8 (per tensor, channel, block, MXFP8) and MXFP4 weights",
        )
        return None
    if dtype == _FP8:
        return _fp8(spec, scheme, where, s)
    if dtype == "fp4" and scheme == "per_group" and spec.get("group_size") == MXFP4_GROUP and _e8m0(spec):
        s.packed["mxfp4"] = MXFP4_GROUP
        return None
    named = _NOT_DECODED.get(dtype, dtype)
    s.refuse(
        f"Quark {where}.weight is {named} ({dtype}, {scheme}, group_size {spec.get('group_size')!r}); "
        "fp8conv does not decode it",
        fix="fp8conv reads Quark FP8 (per tensor, channel, block, MXFP8) and MXFP4 (fp4 per_group 32, e8m0) weights",
    )
    return None


def _fp8(spec: dict[str, Any], scheme: str, where: str, s: QuantSettings) -> tuple[int, int] | None:
    if scheme in ("per_tensor", "per_channel"):  # the scale's shape says which (the classifier)
        return None
    if scheme == "per_block":
        try:
            return parse_block_size(spec.get("block_size"), s.key)
        except CheckpointError:
            s.refuse(
                f"Quark {where}.weight is per_block with block_size {spec.get('block_size')!r}, not two integers",
                fix="fix config.json",
            )
            return None
    if scheme == "per_group" and spec.get("group_size") == MXFP8_GROUP and _e8m0(spec):
        s.mxfp8_group = MXFP8_GROUP
        return None
    s.refuse(
        f"Quark {where}.weight is fp8_e4m3 {scheme} with group_size {spec.get('group_size')!r}; fp8conv does not "
        "decode that layout",
        fix="fp8conv reads Quark FP8 per_tensor, per_channel, per_block and per_group 32 (e8m0, MXFP8)",
    )
    return None


def _e8m0(spec: dict[str, Any]) -> bool:
    return "e8m0" in str(spec.get("scale_format", "")) or "e8m0" in str(spec.get("scale_type", ""))


def _activations(spec: Any, s: QuantSettings) -> None:
    if isinstance(spec, dict):
        dynamic = spec.get("is_dynamic", spec.get("dynamic"))
        s.activation_scheme = "static" if dynamic is False else (s.activation_scheme or "dynamic")


def _blocks(blocks: dict[str, tuple[int, int]], layers: dict[str, Any], s: QuantSettings) -> None:
    """The global config's block size for the checkpoint, and one scheme per layer_quant_config key in its
    order (the first key matching a module gives its block, None where that key is not per_block), so a
    module takes the block of the config the loaders give it."""
    s.block = blocks.get("global_quant_config")
    if any(where != "global_quant_config" for where in blocks):
        s.schemes = tuple(ModuleScheme(key, blocks.get(f"layer_quant_config[{key!r}]")) for key in layers)
