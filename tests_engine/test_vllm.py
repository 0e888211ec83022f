"""vLLM (CPU build, offline) serves fp8conv's outputs.

Computed by vLLM on any x86 CPU: the bf16 output of every model, and the channel FP8 output of the dense
model (ChannelWiseTorchFP8ScaledMMLinearKernel). LOAD-ONLY: the block FP8 outputs (padded with
--pad-for-tp 2) and the channel MoE outputs go through vLLM's model construction and weight loaders at
tensor-parallel 1 and 2, without computing, with vLLM's CPU FP8 kernels declared available (vllm_worker.py
_declare_cpu_fp8_kernels), so the same checks run on every host. vLLM computes block FP8 Linear layers and
FP8 MoE only with AMX and the fp8_scaled_mm_cpu op (its AVX-512-with-bf16 build): where the CPU has both,
the padded block outputs are computed too; elsewhere those tests skip, naming what is missing.
FP8CONV_VLLM_CPU=avx2 (`make test-avx2`) makes vLLM see an AVX2-only CPU on any host. LOAD-ONLY too: the
power-of-two outputs (--to block --scale-fmt ue8m0, --to mxfp8), MXFP8 with vLLM's emulation kernels
declared available on the CPU (vllm_worker._declare_cpu_mxfp8_kernels).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from .conftest import VERDICTS, fp8conv_cli, run_worker, worker_json
from .models import BLOCK, KINDS

transformers = pytest.importorskip("transformers")

PROMPT = [1, 7, 42, 3, 99, 250, 17, 5]  # vllm_worker.PROMPT
MAX_TOKENS = 8

# vLLM's bf16 kernels and transformers' differ in accumulation order: the same token's log-probability
# agrees within BF16_LOGPROB_TOL (nats). Random tiny models have near-tied logits, so a greedy token may
# flip where transformers' top two are within that tolerance; the sequences then differ and the
# comparison stops there (a flip anywhere else fails).
BF16_LOGPROB_TOL = 0.05
# Channel FP8 in vLLM quantizes activations per token to FP8 (W8A8); transformers with compressed-tensors
# runs the same weights with its own fake quantization: first-token log-probabilities within this (nats).
CHANNEL_LOGPROB_TOL = 0.1


def _transformers_greedy(path, **kwargs) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's log-probabilities, full recompute each step (no cache to differ)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs)
    ids = torch.tensor([PROMPT])
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            lp = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
            tok = int(lp.argmax())
            tokens.append(tok)
            logprobs.append(lp)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return tokens, logprobs


def _compare_greedy(vllm_out: dict, hf_tokens: list[int], hf_logprobs: list[torch.Tensor], tol: float) -> str:
    """Token by token: equal tokens with log-probabilities within tol, or a flip between a near tie."""
    assert len(vllm_out["tokens"]) == MAX_TOKENS
    for step, (v_tok, h_tok) in enumerate(zip(vllm_out["tokens"], hf_tokens, strict=True)):
        v_lp = vllm_out["logprobs"][step][str(v_tok)]
        h_lp = hf_logprobs[step]
        assert abs(v_lp - float(h_lp[v_tok])) <= tol, (step, v_tok, v_lp, float(h_lp[v_tok]))
        if v_tok != h_tok:
            margin = float(h_lp[h_tok] - h_lp[v_tok])
            assert margin <= tol, f"step {step}: vLLM {v_tok}, transformers {h_tok}, margin {margin:.4f} > {tol}"
            return f"equal for {step} tokens, then a near tie flipped (margin {margin:.4f})"
    return f"all {MAX_TOKENS} tokens equal"


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_output_greedy_tokens_match_transformers(converted, kind, tmp_path):
    path = converted[kind].bf16
    args = ["generate", str(path), str(tmp_path / "out.json")]
    if kind == "deepseek_v3":
        args.append("--native-rope")  # see vllm_worker.generate: the CPU rotary op is wrong on MLA's views
    got = worker_json(f"{kind} bf16: generate", *args, out=tmp_path / "out.json")
    hf_tokens, hf_logprobs = _transformers_greedy(path)
    verdict = _compare_greedy(got, hf_tokens, hf_logprobs, BF16_LOGPROB_TOL)
    VERDICTS.append(f"COMPUTED {kind} bf16: vLLM {got['tokens']} transformers {hf_tokens}: {verdict}")


# What vLLM 0.32 says where this CPU lacks the kernels (no AMX, no fp8_scaled_mm_cpu op): then block FP8
# is checked load-only. The worker's own line (vllm_worker.KERNELS_LINE) names what is missing.
NO_CPU_KERNEL = ("requires AMX tile support", "fp8_scaled_mm_cpu op not available", "Unsupported FP8 MoE backend")
KERNELS_LINE = "fp8conv-worker: vLLM's CPU FP8 kernels here:"
# The channel dense model's FP8 Linear kernels on a CPU: torch's, or vLLM's AMX-FP8 one where the chip has it
CHANNEL_FP8_KERNELS = ("ChannelWiseTorchFP8ScaledMMLinearKernel", "CPUFP8W8A8ScaledMMLinearKernel")


# INT8 W8A8 in vLLM (oneDNN on the CPU) against the exact weights (the bf16 output, in transformers): the
# same token's log-probability within this (nats). Weights move by up to half a step of amax / 127 per row
# (~0.7% rms on these gaussian rows) and every activation by half a step of its token's amax / 127. On this
# 2-layer model: the 8 chosen tokens within 0.045 (AVX-512 host); the AVX2 build (make test-avx2) within
# 0.047, then a near tie flips at the third token, whose log-probability differed by 0.080: twice that.
INT8_LOGPROB_TOL = 0.16
INT8_KERNEL = "CPUInt8ScaledMMLinearKernel"


def _missing_cpu_kernels(stderr: str) -> str:
    line = next((x for x in stderr.splitlines() if x.startswith(KERNELS_LINE)), KERNELS_LINE + " (not reported)")
    return line.removeprefix(KERNELS_LINE).strip()


@pytest.mark.parametrize("kind", KINDS)
def test_block_padded_output_computed_by_vllm_where_the_cpu_has_its_kernel(converted, kind, tmp_path):
    """Where the CPU has AMX, vLLM computes block FP8 (CPUFp8BlockScaledMMKernel, bf16 activations): the
    --pad-for-tp 2 output gives transformers' greedy tokens on the bf16 output of the same checkpoint (the
    padding adds exact zeros). Without AMX vLLM refuses its kernel, and this test is skipped saying so."""
    path = converted[kind].block_tp2
    args = ["generate", str(path), str(tmp_path / "out.json")]
    if kind == "deepseek_v3":
        args.append("--native-rope")
    proc = run_worker(f"{kind} block --pad-for-tp 2: generate", *args)
    if proc.returncode != 0:
        refusal = next((line for line in proc.stderr.splitlines() if any(m in line for m in NO_CPU_KERNEL)), None)
        if refusal is not None:
            missing = _missing_cpu_kernels(proc.stderr)
            VERDICTS.append(f"NOT COMPUTED {kind} block (load-only below): {missing}; vLLM: {refusal.strip()}")
            pytest.skip(f"vLLM has no block FP8 kernel on this CPU: {missing}; vLLM says: {refusal.strip()}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    got = json.loads((tmp_path / "out.json").read_text())
    hf_tokens, hf_logprobs = _transformers_greedy(converted[kind].bf16)
    verdict = _compare_greedy(got, hf_tokens, hf_logprobs, BF16_LOGPROB_TOL)
    VERDICTS.append(f"COMPUTED {kind} block (padded, this CPU has AMX): vLLM {got['tokens']}: {verdict}")


def test_int8_dense_output_computed_by_vllm_matches_the_bf16_output(converted, tmp_path):
    """vLLM computes the --to int8 output with its INT8 kernel (dynamic per-token INT8 activations): its
    greedy tokens and their log-probabilities are those of the exact weights (the bf16 output) in
    transformers, within INT8_LOGPROB_TOL (or a near tie flips)."""
    path = converted["qwen3"].int8
    proc = run_worker("qwen3 int8: generate", "generate", str(path), str(tmp_path / "out.json"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert INT8_KERNEL in proc.stdout + proc.stderr  # vLLM ran INT8, not bf16
    got = json.loads((tmp_path / "out.json").read_text())
    hf_tokens, hf_logprobs = _transformers_greedy(converted["qwen3"].bf16)
    verdict = _compare_greedy(got, hf_tokens, hf_logprobs, INT8_LOGPROB_TOL)
    same = [s for s, (v, h) in enumerate(zip(got["tokens"], hf_tokens, strict=True)) if v == h]
    same = same[: next((i for i, s in enumerate(same) if s != i), len(same))]  # up to the first flip
    worst = max(abs(got["logprobs"][s][str(got["tokens"][s])] - float(hf_logprobs[s][got["tokens"][s]])) for s in same)
    VERDICTS.append(
        f"COMPUTED qwen3 int8 ({INT8_KERNEL}): {verdict}; the chosen tokens' log-probabilities within {worst:.4f} "
        "of the bf16 output's in transformers"
    )


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_channel_dense_output_computed_by_vllm_matches_transformers(converted, tmp_path):
    pytest.importorskip("compressed_tensors")
    path = converted["qwen3"].channel
    proc = run_worker("qwen3 channel: generate", "generate", str(path), str(tmp_path / "out.json"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert any(k in proc.stdout + proc.stderr for k in CHANNEL_FP8_KERNELS)  # vLLM ran FP8, not bf16
    got = json.loads((tmp_path / "out.json").read_text())
    _, hf_logprobs = _transformers_greedy(path)  # compressed-tensors, as users load it
    first = got["logprobs"][0]
    diffs = {int(t): abs(lp - float(hf_logprobs[0][int(t)])) for t, lp in first.items()}
    assert max(diffs.values()) <= CHANNEL_LOGPROB_TOL, diffs
    VERDICTS.append(
        f"COMPUTED qwen3 channel (FP8 kernel): first-token top-{len(diffs)} log-probabilities "
        f"within {max(diffs.values()):.4f} of transformers + compressed-tensors"
    )


# A LoRA merged into the FP8 release (--merge-lora): vLLM computes the merged bf16 and channel outputs; the
# reference is PEFT's own merge_and_unload on the exact weights (the bf16 output), run in transformers. bf16:
# BF16_LOGPROB_TOL, as for the unmerged bf16 output. Channel: e4m3 weights (2^-4 of each value) and FP8
# activations per token against the exact merged weights: the first token's top log-probabilities within
# MERGED_CHANNEL_LOGPROB_TOL (nats; measured 0.039 on an AVX-512 host, vLLM's torch FP8 kernel).
MERGED_CHANNEL_LOGPROB_TOL = 0.1


def _peft_merged(base: Path, root: Path) -> tuple[Path, Path]:
    """A LoRA adapter PEFT makes on `base` (q/v/down projections, rank 8, a fine-tune's size), and PEFT's
    merged model saved beside it: (adapter, merged model)."""
    from peft import LoraConfig

    from tests.support.peft_adapters import saved_adapter

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(1)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    merged = saved_adapter(model, config, root / "adapter", 0.2)
    model.load_state_dict(merged)  # PEFT's merge, saved as a plain model
    model.to(torch.bfloat16).save_pretrained(root / "peft-merged")
    return root / "adapter", root / "peft-merged"


def test_lora_merged_outputs_computed_by_vllm_match_the_peft_model(converted, tmp_path):
    """--merge-lora into the qwen3 block FP8 release: vLLM serves the merged bf16 output with the PEFT
    model's greedy tokens (or a near tie flips), and computes the merged channel FP8 output's first token
    close to it; the merge moved the model (its tokens differ from the base's somewhere, or its
    log-probabilities by more than the tolerance)."""
    fp8, base = converted["qwen3"].fp8, converted["qwen3"].bf16
    adapter, reference = _peft_merged(base, tmp_path)
    hf_tokens, hf_logprobs = _transformers_greedy(reference)
    base_tokens, base_logprobs = _transformers_greedy(base)
    moved = max(float((a - b).abs().max()) for a, b in zip(hf_logprobs, base_logprobs, strict=True))
    assert hf_tokens != base_tokens or moved > 2 * BF16_LOGPROB_TOL, moved
    lines = []
    for to in ("bf16", "channel"):
        out = tmp_path / f"merged-{to}"
        fp8conv_cli("convert", str(fp8), "--to", to, "--merge-lora", str(adapter), "-o", str(out))
        proc = run_worker(f"qwen3 merged {to}: generate", "generate", str(out), str(tmp_path / f"{to}.json"))
        assert proc.returncode == 0, proc.stderr[-5000:]
        got = json.loads((tmp_path / f"{to}.json").read_text())
        if to == "bf16":
            lines.append(f"bf16 {_compare_greedy(got, hf_tokens, hf_logprobs, BF16_LOGPROB_TOL)}")
            continue
        assert any(k in proc.stdout + proc.stderr for k in CHANNEL_FP8_KERNELS)  # vLLM ran FP8, not bf16
        diffs = {int(t): abs(lp - float(hf_logprobs[0][int(t)])) for t, lp in got["logprobs"][0].items()}
        assert max(diffs.values()) <= MERGED_CHANNEL_LOGPROB_TOL, diffs
        lines.append(f"channel first-token top-{len(diffs)} within {max(diffs.values()):.4f}")
    VERDICTS.append(f"COMPUTED qwen3 + LoRA merged (PEFT's merge as the reference): {'; '.join(lines)}")


# ---- LOAD-ONLY: vLLM's model construction and weight loaders at TP 1 and 2, no compute ----

# Checkpoint modules vLLM fuses into one parameter, in its order (stacked_params_mapping of the models).
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}


def _checkpoint(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _parts(name: str, ckpt: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """The checkpoint tensors behind one vLLM parameter, and the axis they are concatenated on."""
    prefix, _, leaf = name.rpartition(".")
    module = prefix.rpartition(".")[2]
    if module in FUSED:
        base = prefix.rpartition(".")[0]
        return [ckpt[f"{base}.{part}.{leaf}"] for part in FUSED[module]], 0
    if leaf.startswith(("w13_", "w2_")):  # FusedMoE: [E, 2I, H] and [E, H, I]
        prefix = prefix.removesuffix(".routed_experts")  # vLLM 0.32's module path for the routed experts
        suffix = leaf.split("_", 1)[1]
        experts = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in ckpt if n.startswith(prefix + ".")})
        projs = ("gate_proj", "up_proj") if leaf.startswith("w13_") else ("down_proj",)
        stacks = [torch.stack([ckpt[f"{prefix}.{e}.{p}.{suffix}"] for e in experts]) for p in projs]
        return stacks, 1
    return [ckpt[name]], 0


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _e8m0_values(t: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu bytes b as the float32 2^(b - 127) they mean, from the bits (not torch's cast)."""
    assert t.dtype == torch.float8_e8m0fnu and not bool((t.view(torch.uint8) == 0xFF).any()), "an E8M0 NaN"
    return (t.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)


def _as_vllm_holds(t: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32 creates block FP8 scales as float32 parameters whatever the checkpoint stores
    (Fp8LinearMethod: Fp8Config has no is_scale_e8m0, so scale_dtype stays None; Fp8MoEMethod: float32
    outright); its weight loaders copy_ a float8_e8m0fnu scale into them, which is 2^(b - 127) exactly.
    So an E8M0 checkpoint scale arrives unchanged as that float32 value. MXFP8's uint8 scales are kept
    as uint8 (ModelOptMxFp8: MXFP8_SCALE_DTYPE): bytes, compared as they are."""
    return _e8m0_values(t) if t.dtype == torch.float8_e8m0fnu else t


def _check_rank(name: str, got: torch.Tensor, parts: list[torch.Tensor], axis: int, rank: int, tp: int) -> str:
    """A rank's parameter is the whole tensor (replicated) or, along one axis, the rank-th 1/tp of every
    fused part, concatenated: the bytes of the checkpoint, nothing else."""
    whole = torch.cat([_as_vllm_holds(p) for p in parts], dim=axis)
    if got.shape == whole.shape:
        assert _same_bits(got, whole), f"{name}: rank {rank} holds other bytes than the checkpoint"
        return "replicated"
    split = [d for d in range(got.dim()) if got.shape[d] != whole.shape[d]]
    assert len(split) == 1, (name, tuple(got.shape), tuple(whole.shape))
    d = split[0]
    pieces = []
    for part in map(_as_vllm_holds, parts):
        assert part.shape[d] % tp == 0, (name, tuple(part.shape), d, tp)
        size = part.shape[d] // tp
        pieces.append(part.narrow(d, rank * size, size))
    expected = torch.cat(pieces, dim=axis)
    assert _same_bits(got, expected), f"{name}: rank {rank} of {tp} holds other bytes than its slice (axis {d})"
    return f"split on axis {d}"


def _check_whole_blocks(params: dict[str, torch.Tensor], name: str) -> None:
    """Block FP8: every rank's weight is exactly its scale grid times the block on a sharded axis."""
    scale = params[name]
    weight = params[name.removesuffix("_scale_inv")]
    assert weight.dtype == torch.float8_e4m3fn, name
    for d in (-2, -1):
        assert scale.shape[d] == math.ceil(weight.shape[d] / BLOCK), (name, tuple(weight.shape), tuple(scale.shape))


# vLLM's FP8 methods give every attention layer KV-cache quantization parameters of its own (q/k/v/prob
# scales, compressed-tensors also zero points); a checkpoint without them (FP8 weights, bf16 KV cache)
# leaves vLLM's defaults, which its loader accepts.
KV_CACHE_SCALE = re.compile(r"\.attn\.(q|k|v|prob)_(scale|zero_point)$")

LOAD_ONLY = [
    ("deepseek_v3", "block_tp2"),
    ("qwen3_moe", "block_tp2"),
    ("qwen3", "block_tp2"),
    ("deepseek_v3", "channel"),
    ("qwen3_moe", "channel"),
    ("deepseek_v3", "int8"),
    ("qwen3_moe", "int8"),
]


UNPADDED = "deepseek_v3-block-unpadded"
KV_MODEL = "qwen3-channel-kv-cache"
# a compressed-tensors FP8 KV cache (per-tensor static k/v scales), as llm-compressor declares it
KV_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


@pytest.fixture(scope="module")
def kv_channel(converted, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """qwen3's channel output given per-layer `self_attn.k_scale` / `v_scale` and a kv_cache_scheme (a
    compressed-tensors FP8-KV-cache checkpoint), converted --to channel again by the CLI; and its scales."""
    import shutil

    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("kv")
    src = root / "input"
    shutil.copytree(converted["qwen3"].channel, src, ignore=shutil.ignore_patterns(".fp8conv"))
    scales = {
        f"model.layers.{i}.self_attn.{p}_scale": torch.tensor(0.0625 * (i + 1) + (p == "v") * 0.03125)
        for i in range(2)
        for p in "kv"
    }
    save_file(scales, str(src / "kv-scales.safetensors"), metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(scales, "kv-scales.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = KV_SCHEME
    (src / "config.json").write_text(json.dumps(config))
    fp8conv_cli("convert", str(src), "--to", "channel", "-o", str(root / "channel"))
    return root / "channel", scales


# Power-of-two (E8M0) scales from the float32 block scales of models.py: each output a requantization
# (every block's exponent searched), so its scales are fp8conv's own. MXFP8 unpadded on the dense model
# (K = 384 / 2 is whole 1x32 groups per rank); the others with --pad-for-tp 2 (ue8m0: 192 is not).
UE8M0_ARGS = ("--to", "block", "--scale-fmt", "ue8m0")
POW2 = {  # the defaults (float32 powers of two; compressed-tensors MXFP8) and the other storage / spelling
    "qwen3-ue8m0-tp2": ("qwen3", (*UE8M0_ARGS, "--pad-for-tp", "2")),
    "qwen3_moe-ue8m0-tp2": ("qwen3_moe", (*UE8M0_ARGS, "--pad-for-tp", "2")),
    "qwen3-ue8m0-e8m0": ("qwen3", (*UE8M0_ARGS, "--scale-dtype", "e8m0", "--pad-for-tp", "2")),
    "qwen3-mxfp8": ("qwen3", ("--to", "mxfp8")),
    "qwen3_moe-mxfp8-tp2": ("qwen3_moe", ("--to", "mxfp8", "--pad-for-tp", "2")),
    "qwen3-mxfp8-modelopt": ("qwen3", ("--to", "mxfp8", "--mxfp8-format", "modelopt")),
}


@pytest.fixture(scope="module")
def pow2(converted, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pow2")
    for name, (kind, args) in POW2.items():
        fp8conv_cli("convert", str(converted[kind].fp8), *args, "-o", str(root / name))
    return {name: root / name for name in POW2}


MERGED_BLOCK = "qwen3-block-tp2-lora"  # --to block --pad-for-tp 2 --merge-lora: the merged block FP8 release


@pytest.fixture(scope="module")
def merged_block(converted, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("merged")
    adapter, _ = _peft_merged(converted["qwen3"].bf16, root)
    out = root / MERGED_BLOCK
    args = ("--to", "block", "--pad-for-tp", "2", "--merge-lora", str(adapter), "-o", str(out))
    fp8conv_cli("convert", str(converted["qwen3"].fp8), *args)
    return out


@pytest.fixture(scope="module")
def loaded(converted, kv_channel, pow2, merged_block, tmp_path_factory):
    """One worker process for every load-only check (vLLM imported once; each model's ranks forked)."""
    out = tmp_path_factory.mktemp("loaded")
    models = [f"{k}-{t}={getattr(converted[k], t)}" for k, t in LOAD_ONLY]
    models.append(f"{UNPADDED}={converted['deepseek_v3'].block}")
    models.append(f"{KV_MODEL}={kv_channel[0]}")
    models += [f"{name}={path}" for name, path in pow2.items()]
    models.append(f"{MERGED_BLOCK}={merged_block}")
    run_worker(f"LOAD-ONLY at TP 1 and 2, {len(models)} checkpoints", "load", str(out), *models, "--tp", "1,2")
    return out


@pytest.mark.parametrize(("kind", "target"), LOAD_ONLY, ids=[f"{k}-{t}" for k, t in LOAD_ONLY])
def test_load_only_vllm_loads_every_weight_at_tp_1_and_2(converted, loaded, kind, target):
    """LOAD-ONLY (no compute, the CPU FP8 kernels declared available): vLLM builds the model, its loaders
    accept every weight (DefaultModelLoader refuses a parameter the checkpoint left uninitialized), and each
    rank's parameters are the checkpoint's bytes, split the way tensor parallelism splits them."""
    path = getattr(converted[kind], target)
    used, quantized = _check_loaded(path, loaded / f"{kind}-{target}")
    VERDICTS.append(
        f"LOAD-ONLY {kind} {target}: {len(used)} parameters at TP 1 and 2, {len(quantized)} quantization scales"
    )


def test_load_only_vllm_loads_the_lora_merged_block_output_at_tp_1_and_2(merged_block, loaded):
    """LOAD-ONLY, as above: the block FP8 release with a LoRA merged in (--pad-for-tp 2) loads in vLLM with
    every parameter the checkpoint's bytes, the merged projections' fresh scales among them."""
    used, quantized = _check_loaded(merged_block, loaded / MERGED_BLOCK)
    VERDICTS.append(f"LOAD-ONLY {MERGED_BLOCK}: {len(used)} parameters at TP 1 and 2, {len(quantized)} scales")


@pytest.mark.parametrize("name", POW2)
def test_load_only_vllm_loads_power_of_two_scales_unchanged_at_tp_1_and_2(pow2, loaded, name):
    """LOAD-ONLY, as above, for --to block --scale-fmt ue8m0 (weight_scale_inv as float32 powers of two by
    default, float8_e8m0fnu with --scale-dtype e8m0; scale_fmt ue8m0) and --to mxfp8 (compressed-tensors
    mxfp8-quantized by default, ModelOpt MXFP8 with --mxfp8-format modelopt; uint8 weight_scale per 1x32
    group): vLLM builds the model (MXFP8's emulation kernels declared available on the CPU,
    vllm_worker._declare_cpu_mxfp8_kernels), loads every weight, and each rank's scales are the written
    exponents: the bytes for MXFP8, the exact float32 2^(b - 127) for ue8m0 (vLLM's block FP8 scale
    parameters are float32; _as_vllm_holds)."""
    path = pow2[name]
    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    ue8m0 = "ue8m0" in name
    if ue8m0:
        assert quant.get("scale_fmt") == "ue8m0", quant
    elif name.endswith("modelopt"):
        assert quant.get("quant_algo") == "MXFP8", quant
    else:  # vLLM's CompressedTensorsW8A8Mxfp8 (and its MoE method) read this spelling
        assert quant.get("format") == "mxfp8-quantized", quant
    used, quantized = _check_loaded(path, loaded / name)
    stored = {t.dtype for n, t in _checkpoint(path).items() if n.endswith(("_scale_inv", "_scale"))}
    want = (torch.float8_e8m0fnu if name.endswith("e8m0") else torch.float32) if ue8m0 else torch.uint8
    assert stored == {want}, stored
    held = {t.dtype for n, t in torch.load(loaded / name / "tp1" / "rank0.pt").items() if n in quantized}
    assert held == {torch.float32 if ue8m0 else torch.uint8}, held  # what vLLM 0.32 makes of them
    VERDICTS.append(
        f"LOAD-ONLY {name}: {len(used)} parameters at TP 1 and 2, {len(quantized)} E8M0 scales "
        f"arrived unchanged (held as {held.pop()})"
    )


def _check_loaded(path: Path, folder: Path) -> tuple[set[str], list[str]]:
    """Every rank of TP 1 and 2 loaded `path` with the checkpoint's bytes in each parameter, split as
    tensor parallelism splits them; the parameters vLLM built, and its FP8 scales."""
    errors = "\n".join(p.read_text()[:3000] for p in sorted(folder.glob("tp*/rank*.err")))
    assert not errors, errors
    ckpt = _checkpoint(path)
    used: set[str] = set()
    layouts: dict[str, str] = {}
    for tp in (1, 2):
        for rank in range(tp):
            params = torch.load(folder / f"tp{tp}" / f"rank{rank}.pt")
            for name, got in params.items():
                if KV_CACHE_SCALE.search(name):
                    continue
                parts, axis = _parts(name, ckpt)
                layouts[name] = _check_rank(name, got, parts, axis, rank, tp)
                if name.endswith("weight_scale_inv"):
                    _check_whole_blocks(params, name)
            if tp == 1:
                used = {n for n in params if not KV_CACHE_SCALE.search(n)}
    assert any(v.startswith("split") for v in layouts.values()), layouts  # TP 2 really split something
    quantized = [n for n in used if n.endswith(("weight_scale_inv", "weight_scale"))]
    assert quantized, f"no FP8 parameter in vLLM's model of {path.name}"
    return used, quantized


def test_load_only_unpadded_block_output_refused_by_vllm(loaded):
    """What --pad-for-tp fixes (the padded output loads above): DeepSeek's moe_intermediate_size 192 and
    intermediate_size 384 are not whole 128-blocks per rank. vLLM refuses the unpadded block output for its
    shapes, with the kernels declared available as above. At TP 1 in its MoE weight loader: vLLM refines the
    experts' blocks to 64 to fit 192 and upsamples each checkpoint scale 2 x 2, but the last 128-block of
    the down projections (w2) is partial: 2 scale columns become 4 where vLLM's grid has 3. At TP 2 in
    create_weights, before loading: the dense layer's 384 / 2 = 192 is not whole blocks per rank."""
    tp1 = (loaded / UNPADDED / "tp1" / "rank0.err").read_text()
    assert re.match(r"RuntimeError: The size of tensor a \(\d+\) must match the size of tensor b", tp1), tp1[-3000:]
    assert "in _load_w2" in tp1, tp1[-3000:]
    tp2 = (loaded / UNPADDED / "tp2" / "rank0.err").read_text().splitlines()[0]
    assert re.search(r"= 192 is not divisible by weight quantization block_[nk] = 128", tp2), tp2
    VERDICTS.append(
        f"LOAD-ONLY deepseek_v3 block unpadded, refused by vLLM: TP 1: {tp1.splitlines()[0]} (loading w2); TP 2: {tp2}"
    )


def test_load_only_vllm_reads_the_kept_kv_cache_scheme_and_loads_the_kv_scales(kv_channel, loaded):
    """The channel output keeps the input's kv_cache_scheme beside its KV scales: vLLM turns the KV cache
    dtype "auto" into fp8 (as it did for the input; the same model without the declaration stays "auto")
    and loads each layer's scales into its attention layer, at TP 1 and 2."""
    path, scales = kv_channel
    assert json.loads((path / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] == KV_SCHEME
    errors = "\n".join(p.read_text()[:3000] for p in sorted((loaded / KV_MODEL).glob("tp*/rank*.err")))
    assert not errors, errors
    for tp in (1, 2):
        for rank in range(tp):
            folder = loaded / KV_MODEL / f"tp{tp}"
            assert json.loads((folder / f"rank{rank}.json").read_text())["cache_dtype"] == "fp8"
            plain = loaded / "qwen3_moe-channel" / f"tp{tp}" / f"rank{rank}.json"
            assert json.loads(plain.read_text())["cache_dtype"] == "auto"
            params = torch.load(folder / f"rank{rank}.pt")
            for name, t in scales.items():
                got = params[name.replace(".self_attn.", ".self_attn.attn.")]
                assert torch.equal(got.float().flatten(), t.reshape(1)), (name, got, t)
    VERDICTS.append(f"LOAD-ONLY qwen3 channel + kv_cache_scheme: KV cache fp8, {len(scales)} KV scales at TP 1 and 2")
