"""Helpers for running real ranks on CPU over gloo, shared by tests, benchmarks and recipes' checks.

Nothing here is needed at training time; it exists so every distributed test launches ranks
the same way a user would (``torchrun`` / ``accelerate launch``) with a bounded time.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from hf_dist.embedded.model import tiny_llama_config  # noqa: F401  (tests build the embedded model)
from hf_dist.runtime.launch import GLOO_ABORT, REPO_ROOT, cpu_env, free_port  # noqa: F401  (re-exported for tests)

T = TypeVar("T")

# Public Llama 3 / 3.1 text shapes, written out by hand (no hub access): hidden, intermediate, layers, heads,
# KV heads; vocabulary 128256, untied embeddings. For planner tests and benchmarks (configs only).
LLAMA3_SHAPES = {
    "Llama-3-8B": (4096, 14336, 32, 32, 8),
    "Llama-3-70B": (8192, 28672, 80, 64, 8),
    "Llama-3.1-8B": (4096, 14336, 32, 32, 8),
    "Llama-3.1-70B": (8192, 28672, 80, 64, 8),
    "Llama-3.1-405B": (16384, 53248, 126, 128, 8),
}

# their positions: Llama 3 trained 8192; Llama 3.1 reaches 131072 by scaling RoPE (its config.json's rope_scaling)
_LLAMA3_POSITIONS = dict(max_position_embeddings=8192)
_LLAMA31_POSITIONS = dict(
    max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
)  # fmt: skip


def llama3_config(name: str):
    """A ``LlamaConfig`` with the shape and positions of a public Llama 3 model (:data:`LLAMA3_SHAPES`)."""
    from transformers import LlamaConfig

    hidden, inter, layers, heads, kv = LLAMA3_SHAPES[name]
    positions = _LLAMA31_POSITIONS if name.startswith("Llama-3.1") else _LLAMA3_POSITIONS
    return LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=128256, rope_theta=500000.0, **positions,
    )  # fmt: skip


# Public models' config values, written out by hand from their published config.json (no hub access), for the
# tracer's accuracy benchmark and tests: the fields that decide shapes and the modelling code path.
PUBLIC_CONFIGS: dict[str, dict] = {
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                       max_position_embeddings=8192),
    "llama-3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        max_position_embeddings=8192),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                       max_position_embeddings=32768, tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32768, rope_theta=1000000.0,
                       max_position_embeddings=32768, sliding_window=None),
    "gemma-2-9b": dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                       final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=256,
                       sliding_window=4096, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                         num_experts_per_tok=2, rope_theta=1000000.0, max_position_embeddings=32768),
    # Qwen/Qwen1.5-MoE-A2.7B: 60 routed experts (top-4) and one shared expert behind a sigmoid gate in every layer
    "qwen1.5-moe-a2.7b": dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                              num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
                              max_position_embeddings=8192, rope_theta=1000000.0, tie_word_embeddings=False,
                              use_sliding_window=False, sliding_window=32768, max_window_layers=21, rms_norm_eps=1e-6,
                              decoder_sparse_step=1, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                              num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, output_router_logits=False,
                              router_aux_loss_coef=0.001),
    # deepseek-ai/DeepSeek-V2-Lite: multi-head latent attention, 64 routed experts (top-6) and 2 shared experts in
    # every layer but the first (dense)
    "deepseek-v2-lite": dict(model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16, vocab_size=102400,
                             max_position_embeddings=163840, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=1408, n_routed_experts=64,
                             n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, n_group=1,
                             topk_group=1, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
                             rope_theta=10000, rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                             "original_max_position_embeddings": 4096},
                             tie_word_embeddings=False, rms_norm_eps=1e-6, attention_bias=False),
}  # fmt: skip


def public_config(name: str):
    """The transformers config of a public model in :data:`PUBLIC_CONFIGS`."""
    from hf_dist.planning.model_source import config_from_dict

    return config_from_dict(dict(PUBLIC_CONFIGS[name]))


# a GPU case's LoRA as ../shared/gpu/gpu_memory.py records it: "r=16, alpha=32, dropout=0.0 (...), all linear layers"
_CASE_LORA = re.compile(r"r=(?P<r>\d+), alpha=(?P<alpha>[\d.]+), dropout=(?P<dropout>[\d.]+).*, (?P<targets>.+)$")


def gpu_case_lora(case: dict):
    """The :class:`~hf_dist.planning.lora.LoraSpec` a measured GPU case trained (its ``lora`` field), None for full
    fine-tuning; a description this cannot read is refused rather than planned as another LoRA."""
    from hf_dist.planning.lora import LoraSpec

    text = case.get("lora")
    if case["method"] == "full" or text is None:
        return None
    match = _CASE_LORA.match(text)
    targets = {"all linear layers": "all-linear"}.get(match["targets"].strip()) if match else None
    if targets is None:
        raise ValueError(f"cannot read the LoRA of case {case['model']}: {text!r}; expected 'r=.., alpha=.., "
                         "dropout=.., all linear layers'")  # fmt: skip
    return LoraSpec(rank=int(match["r"]), alpha=float(match["alpha"]), dropout=float(match["dropout"]),
                    targets=targets, source="peft_config")  # fmt: skip


def torchrun(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    cwd: str | Path | None = None,
    extra_launcher_args: Sequence[str] = (),
    outputs: Sequence[str | Path] = (),
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` CPU ranks with torchrun; raise with the output on failure.

    ``outputs`` are the files and folders the launch writes. A launch whose rank dies of gloo's rare abort
    (:data:`GLOO_ABORT`) is launched once more (:func:`retry_gloo_abort`) after removing what the first attempt
    added there: a folder keeps the entries it had before, a file or folder that did not exist goes.
    """

    def launch() -> subprocess.CompletedProcess:
        cmd = torchrun_command(script, args, nproc=nproc, extra_launcher_args=extra_launcher_args)
        return run_checked(cmd, env=cpu_env(env), timeout=timeout, cwd=cwd)

    return relaunch_on_gloo_abort(launch, outputs)


def relaunch_on_gloo_abort(launch: Callable[[], T], outputs: Sequence[str | Path]) -> T:
    """``launch()``, once more when a rank died of :data:`GLOO_ABORT` (:func:`retry_gloo_abort`), after removing
    what the first attempt added to ``outputs``: a folder keeps the entries it had before, a file or folder that
    did not exist goes. ``launch`` must build its command afresh (a new port) each time it is called."""
    before = {Path(path): _entries(Path(path)) for path in outputs}

    def attempt(n: int) -> T:
        if n:
            for path, entries in before.items():
                _remove_new(path, entries)
        return launch()

    return retry_gloo_abort(attempt)


def _entries(path: Path) -> set[str] | None:
    """The names in folder ``path``; an empty set for an existing file; None when nothing is there."""
    if path.is_dir():
        return {child.name for child in path.iterdir()}
    return set() if path.exists() else None


def _remove_new(path: Path, entries: set[str] | None) -> None:
    """Remove what appeared at ``path`` since :func:`_entries` returned ``entries``."""
    if entries is None:
        new = [path] if path.exists() or path.is_symlink() else []
    else:
        new = [child for child in path.iterdir() if child.name not in entries] if path.is_dir() else []
    for item in new:
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item)
        else:
            item.unlink()


def torchrun_command(
    script: str | Path, args: Sequence[str] = (), *, nproc: int = 2, extra_launcher_args: Sequence[str] = ()
) -> list[str]:
    """The torchrun command line for ``script`` on ``nproc`` local ranks, on a free port of 127.0.0.1."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *extra_launcher_args,
        str(script),
        *map(str, args),
    ]


def run_checked(cmd: Sequence[str], *, env: dict[str, str], timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (launcher and ranks)."""
    with subprocess.Popen(
        list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            raise RuntimeError(_failure(f"timed out after {timeout:.0f}s", cmd, stdout, stderr)) from None
    proc = subprocess.CompletedProcess(list(cmd), popen.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise RuntimeError(_failure(f"failed with exit code {proc.returncode}", cmd, stdout, stderr))
    return proc


def retry_gloo_abort(launch: Callable[[int], T]) -> T:
    """``launch(attempt)``, once more (``attempt`` 1) when a rank died of :data:`GLOO_ABORT`, with a warning that
    names it; any other failure, or a second abort, raises. ``launch`` must start afresh for each attempt (its own
    output folder), so the retried launch proves everything the first would have."""
    try:
        return launch(0)
    except RuntimeError as exc:
        if GLOO_ABORT not in str(exc):
            raise
        warnings.warn(
            f"a rank died of gloo's rare abort ({GLOO_ABORT!r}); launching once more", RuntimeWarning, stacklevel=2
        )
        return launch(1)


# lines that say why a rank died; launchers bury them under pages of other ranks' output
_CAUSE = re.compile(
    r"terminate called|what\(\):|Fatal Python error|Segmentation fault|Aborted|"
    r"^\w+(Error|Exception|Exit)\b|^\[rank\d+\]:\s*\w+(Error|Exception)\b|exitcode\s*:|traceback\s*:"
)


def cause_lines(stderr: str) -> list[str]:
    """The distinct lines of a launch's stderr that say why a rank died, in order."""
    return list(dict.fromkeys(line.rstrip() for line in stderr.splitlines() if _CAUSE.search(line)))


def _failure(what: str, cmd: Sequence[str], stdout: str, stderr: str, keep: int = 20) -> str:
    """The error text of a failed launch: the lines naming the cause first, then the output's tails."""
    causes = cause_lines(stderr)
    if len(causes) > 2 * keep:  # the ranks' own errors come first, the launcher's summary last
        causes = [*causes[:keep], "[...]", *causes[-keep:]]
    summary = "\n".join(causes)
    return (
        f"command {what}: {' '.join(cmd)}\n--- lines naming the cause ---\n{summary}\n"
        f"--- stdout (tail) ---\n{stdout[-4000:]}\n--- stderr (tail) ---\n{stderr[-8000:]}"
    ).strip()


# A JIT build of one of DeepSpeed's ops takes about 3.5 minutes here; a build lock older than this was left by a killed
# build (an interrupted `make test`), and torch's FileBaton.wait would wait on it forever
STALE_BUILD_LOCK_S = 30 * 60


def clear_stale_build_locks(
    root: str | os.PathLike | None = None, *, older_than_s: float = STALE_BUILD_LOCK_S
) -> list[Path]:
    """Remove the ``lock`` files that killed JIT extension builds left under ``root`` (default: ``TORCH_EXTENSIONS_DIR``,
    else torch's build root), each named on stderr; a younger lock (a build running now) is kept. ``make aio-op`` and
    ``make test-min`` call it before DeepSpeed's ops are loaded. Returns the removed paths."""
    import time

    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    removed = []
    for lock in sorted(Path(root).glob("**/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
            if age <= older_than_s:
                continue
            lock.unlink()
        except FileNotFoundError:  # released meanwhile
            continue
        removed.append(lock)
        print(f"removed {lock}: a build lock {age / 60:.0f} min old, left by a killed build", file=sys.stderr)
    return removed


def cpu_has_onednn_fp16() -> bool:
    """Whether this CPU computes fp16 through oneDNN (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``).

    DeepSpeed's CPU accelerator asks exactly this before it accepts ``fp16`` (``Type fp16 is not supported on
    your device.``); many x86-64 CPUs answer no (an AMD EPYC with AVX-512 bf16, any AVX2-only CPU).
    """
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def allow_portable_fp16_in_deepspeed() -> bool:
    """Let DeepSpeed's CPU accelerator run fp16 on torch's portable CPU kernels when oneDNN has no fp16.

    Tests need DeepSpeed's fp16 *checkpoint format* (fp16 module weights, fp32 master partitions, loss scaler)
    on any CPU. The engine's fp16 path is the same code either way; only the matmul kernels differ. Returns
    True when it had to patch (the CPU lacks oneDNN fp16), False when DeepSpeed accepts fp16 as is. Tests only.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" or accelerator.is_fp16_supported():
        return False
    type(accelerator).is_fp16_supported = lambda self: True
    return True


class TokenDataset:
    """``n`` fixed random sequences of ``seq`` token ids (labels = inputs) for tiny causal-LM runs."""

    def __init__(self, n: int = 64, seq: int = 16, vocab: int = 256, *, seed: int = 1234) -> None:
        import torch

        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# ---------------------------------------------------------------- measuring CPU tensor memory


def track_all_threads() -> None:
    """Make torch's CPU allocator count every tensor of the process, whichever thread frees it.

    Under the profiler, c10's ``ProfiledCPUMemoryReporter`` counts allocations and frees only in threads where
    memory profiling is on (``memoryProfilingEnabled()`` is thread-local), so a tensor allocated in the main
    thread and freed by a gloo or autograd worker thread (async collectives: FSDP2, TP, DDP's buckets) stays
    "live" forever: the old running sum drifted up step after step and from run to run (FSDP2 model A: 107 ->
    119 MB over 4 steps, 124 -> 152 MB in another run). With ``FLAGS_caffe2_report_cpu_memory_usage`` (a c10
    flag, set through its exported symbol; its log lines are below c10's default log level) the reporter counts
    every thread, and each allocation event the profiler records carries that process-wide total: steady across
    steps and runs (FSDP2 model A: 107.4 MB in every step of two runs). Set before any tensor to measure exists.
    """
    import ctypes

    import torch

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


def memory_curve(prof) -> tuple[list[tuple[int, int]], dict[str, tuple[int, int]]]:
    """((time_ns, live tensor bytes of the process) at every allocation/free recorded, in time order, counted from
    the first one; {record_function name: (start_ns, end_ns)})."""
    import torch

    allocation = torch._C._profiler._ExtraFields_Allocation
    points, marks = [], {}
    for e in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if isinstance(e.extra_fields, allocation):
            points.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated))
        else:
            marks.setdefault(e.name, (e.start_time_ns, e.end_time_ns))
    points.sort()
    base = points[0][2] - points[0][1]  # what was live before the first event (an earlier model's leftovers)
    return [(t, total - base) for t, _, total in points], marks
