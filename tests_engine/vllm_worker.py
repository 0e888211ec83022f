"""Runs inside .venv-engine (vLLM's CPU build); the tests call it and read what it writes. `generate` runs
one model per process; `load` imports vLLM once and forks the ranks of each model and TP size.

  generate MODEL OUT.json [--native-rope]   greedy tokens and top log-probabilities, offline LLM
  load OUT_DIR NAME=MODEL... --tp 1,2       vLLM's model construction and weight loaders, no compute

Not imported by the tests: this file needs vllm, which the main .venv does not have.

What vLLM's CPU build computes depends on the host. It loads one of three kernel libraries by what torch
says of the CPU: _C (AVX-512 with bf16), _C_AVX512 or _C_AVX2, and only _C has the FP8 ops
(fp8_scaled_mm_cpu); its block-FP8 Linear and FP8 MoE kernels also need AMX. With FP8CONV_VLLM_CPU=avx2
vLLM sees an AVX2-only CPU on any x86 host (no AVX-512, no AMX, so it loads _C_AVX2 and has no CPU FP8
ops): `make test-avx2` reproduces that host this way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

PROMPT = [1, 7, 42, 3, 99, 250, 17, 5]
MAX_TOKENS = 8
TOP_LOGPROBS = 5

# In-process engine (no engine-core subprocess) and a small KV cache: a few tokens on a shared CPU box.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
KV_CACHE_BYTES = 64 << 20

SHARED_MEMORY = Path("/dev/shm")  # where vLLM's CPU communicator keeps its segments (load: one group per TP)
CPU_ENV = "FP8CONV_VLLM_CPU"
KERNELS_LINE = "fp8conv-worker: vLLM's CPU FP8 kernels here:"  # the tests read the rest of this stderr line


def _as_avx2_host() -> None:
    """Before vLLM is imported: torch's CPU probes, which vLLM reads to choose its library and kernels, say
    AVX2 only. Probes of the hardware itself that vLLM reads later (AMX-FP8) are answered in _no_amx_fp8."""
    import torch

    for probe in ("avx512", "avx512_bf16", "amx_tile", "amx_fp16"):
        setattr(torch.cpu, f"_is_{probe}_supported", lambda: False)


def _no_amx_fp8() -> None:
    """vLLM's W8A8 CPU kernels need AMX-FP8 hardware (cpu_has_amx_fp8, asked of the chip): declared absent."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    ops.cpu_has_amx_fp8 = cpu_moe.cpu_has_amx_fp8 = lambda: False


def _declare_cpu_fp8_kernels() -> None:
    """LOAD-ONLY: vLLM picks each FP8 (and INT8 MoE) layer's CPU kernel while it builds the model, and refuses
    to build a layer whose kernel this CPU or this build lacks (no AMX; no fp8_scaled_mm_cpu outside _C). Nothing
    computes here, so the W8A16 kernels a CPU with AMX and the FP8 ops would pick are declared available,
    and the AMX-FP8 ones absent: every host builds the same model, parameters and weight loaders."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as linear_cpu
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    _no_amx_fp8()
    ops._supports_cpu_fp8_w8a16 = True
    linear_cpu.CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
    cpu_moe.CPUExpertsFp8._supports_current_device = staticmethod(lambda: True)
    # INT8 W8A8 MoE (--to int8): vLLM's CPU experts need AMX tiles (CPUExpertsInt8) and route by plain top-k
    # only (DeepSeek's grouped top-k runs on a GPU's Triton experts, the same parameters): both declared
    cpu_moe.CPUExpertsInt8._supports_current_device = staticmethod(lambda: True)
    cpu_moe.CPUExpertsInt8._supports_routing_method = staticmethod(lambda *args: True)


def _declare_cpu_mxfp8_kernels() -> None:
    """LOAD-ONLY, as above, for MXFP8 (ModelOpt quant_algo MXFP8): vLLM 0.32 lists no MXFP8 Linear kernel
    for the CPU platform (init_mxfp8_linear_kernel: "Failed to find a kernel that can implement the MXFP8
    linear layer", no reasons) and its MXFP8 MoE experts run on CUDA / XPU only (select_mxfp8_moe_backend:
    "No MXFP8 MoE backends available"). Its BF16-emulation kernels, which need no CPU op to build, are
    declared available for the CPU: the same parameters and weight loaders as on a GPU."""
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.model_executor.layers.fused_moe.experts.mxfp8_emulation_moe import Mxfp8EmulationTritonExperts
    from vllm.platforms import PlatformEnum

    linear._POSSIBLE_MXFP8_KERNELS[PlatformEnum.CPU] = [EmulationMxfp8LinearKernel]
    Mxfp8EmulationTritonExperts._supports_current_device = staticmethod(lambda: True)


def _report_cpu_fp8_kernels() -> None:
    """One line on stderr saying which of vLLM's CPU FP8 needs are missing: a test that skips names them."""
    import torch
    from vllm import _custom_ops as ops

    needs = {"the fp8_scaled_mm_cpu op": ops._supports_cpu_fp8_w8a16, "AMX tiles": torch.cpu._is_amx_tile_supported()}
    missing = [name for name, present in needs.items() if not present]
    state = f"missing {' and '.join(missing)}" if missing else "all present"
    emulated = f" ({CPU_ENV}=avx2)" if os.environ.get(CPU_ENV) == "avx2" else ""
    print(f"{KERNELS_LINE} {state}{emulated}", file=sys.stderr, flush=True)


def generate(model: str, out: Path, native_rope: bool) -> None:
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    t1 = time.perf_counter()
    if os.environ.get(CPU_ENV) == "avx2":
        _no_amx_fp8()
    _report_cpu_fp8_kernels()
    kwargs = {}
    if native_rope:
        # vLLM's CPU rotary op (ops.rotary_embedding, RotaryEmbedding.forward_cpu) rotates MLA's strided
        # q_pe / k_pe views wrongly (vllm/model_executor/layers/mla.py passes q[..., nope:] in place).
        # Disabling the rotary_embedding custom op makes vLLM dispatch to forward_native, plain torch.
        kwargs["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
    llm = LLM(
        model=model,
        enforce_eager=True,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=64,
        max_num_seqs=1,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
        **kwargs,
    )
    t2 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, detokenize=False)
    result = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    t3 = time.perf_counter()
    steps = [{str(tok): lp.logprob for tok, lp in step.items()} for step in result.logprobs]
    timing = {"import_s": t1 - t0, "load_s": t2 - t1, "generate_s": t3 - t2}
    out.write_text(json.dumps({"tokens": list(result.token_ids), "logprobs": steps, "timing": timing}))


def _load_rank(model: str, out: Path, tp: int, rank: int, port: int, ident: str) -> None:
    """One tensor-parallel rank: vLLM builds the model with its quantization method (create_weights, the
    per-rank parameter shapes) and runs the model's load_weights through DefaultModelLoader, which
    refuses any parameter the checkpoint did not initialize. process_weights_after_loading is not run: it
    packs the weights for the compute kernels, which need AMX and the FP8 ops (_declare_cpu_fp8_kernels)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    args = EngineArgs(
        model=model,
        tensor_parallel_size=tp,
        enforce_eager=True,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=64,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        distributed_executor_backend="mp" if tp > 1 else "uni",
    )
    config = args.create_engine_config()
    os.environ["VLLM_DIST_IDENT"] = ident  # what vLLM's CPUWorker sets: the name of its shared-memory group
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=tp,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=tp)
        loader = get_model_loader(config.load_config)
        with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
            net = loader.create_model(vllm_config=config, model_config=config.model_config)
        loader.load_weights(net, config.model_config)
    params = {name: p.detach().clone() for name, p in net.named_parameters()}
    torch.save(params, out / f"rank{rank}.pt")
    # the KV-cache dtype vLLM settled on while building the model (a kv_cache_scheme turns "auto" into fp8)
    (out / f"rank{rank}.json").write_text(json.dumps({"cache_dtype": config.cache_config.cache_dtype}))


def load(models: dict[str, str], out: Path, tps: list[int]) -> int:
    """vLLM is imported once (an import costs seconds); then for each model and TP size, its ranks are
    forked and connected with gloo, so each model's memory goes with its rank processes. Each rank writes
    out/<name>/tp{N}/rank{r}.pt, or rank{r}.err with the exception."""
    import socket

    import vllm  # noqa: F401

    _declare_cpu_fp8_kernels()
    _declare_cpu_mxfp8_kernels()
    failed = 0
    for name, model in models.items():
        timing = {}
        for tp in tps:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            # vLLM names its shared memory (/dev/shm/<ident>-tp:0-[0-1]-cpushm_<rank>, 8 MiB each) after this,
            # and the ranks leave it there (os._exit): the port alone repeats between runs, and a segment
            # left with that name makes the next group's creation fail (errno 17)
            ident = f"fp8conv-{port}-{os.getpid()}-{time.time_ns()}"
            folder = out / name / f"tp{tp}"
            folder.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            pids = []
            for rank in range(tp):
                pid = os.fork()
                if pid == 0:
                    code = 0
                    try:
                        _load_rank(model, folder, tp, rank, port, ident)
                    except BaseException as e:  # the message is what a refusal test asserts on
                        (folder / f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
                        code = 1
                    os._exit(code)
                pids.append(pid)
            for pid in pids:
                _, status = os.waitpid(pid, 0)
                failed |= os.waitstatus_to_exitcode(status) != 0
            for segment in SHARED_MEMORY.glob(f"{ident}-*"):  # this load's alone: its name is unique
                segment.unlink(missing_ok=True)
            timing[f"tp{tp}_s"] = time.perf_counter() - t0
        (out / name / "timing.json").write_text(json.dumps(timing))
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("model")
    g.add_argument("out", type=Path)
    g.add_argument("--native-rope", action="store_true")
    ld = sub.add_parser("load")
    ld.add_argument("out", type=Path)
    ld.add_argument("models", nargs="+", help="NAME=PATH for each checkpoint")
    ld.add_argument("--tp", default="1", help="comma-separated tensor-parallel sizes, e.g. 1,2")
    a = parser.parse_args()
    if os.environ.get(CPU_ENV) == "avx2":
        _as_avx2_host()
    elif os.environ.get(CPU_ENV):
        parser.error(f"{CPU_ENV}: only 'avx2' is understood, not {os.environ[CPU_ENV]!r}")
    if a.cmd == "generate":
        generate(a.model, a.out, a.native_rope)
        return 0
    models = dict(m.split("=", 1) for m in a.models)
    return load(models, a.out, [int(n) for n in a.tp.split(",")])


if __name__ == "__main__":
    sys.exit(main())
