"""ZeRO-Infinity really runs: ZeRO-3 with the optimizer and parameters offloaded to NVMe, planned by ``auto_args``, on
2 CPU ranks under the HF Trainer (tests/distributed/scripts/strategies_train.py), against the same run offloaded to
CPU memory.

DeepSpeed's async-I/O op needs libaio (``make test`` installs it where apt runs as root); the op is built once here
(about 3.5 min on 2 cores, cached in torch's extension folder), before the launches, so they do not race to build it.

The model is the tiny Llama with an 8192-token vocabulary: DeepSpeed keeps any tensor under 1 MiB in memory instead of
a swap file (``hf_dist.planning.nvme.MIN_SWAP_BYTES``), so the embedded model's 256-token vocabulary would swap
nothing. Its norms' sub-group (160 elements per rank) stays in memory for that reason; everything else swaps.

Two launches of two runs each (scripts/runs.py), 4 optimizer steps each, checkpoints at steps 2 and 4:
* ``nvme``: what ran (offload devices, master partitions and Adam moments absent from host memory after every step,
  swap files of the sizes the plan counts), the checkpoint (``offloaded_tensors/``, converted bit-equal);
* ``cpu``: the same layout offloaded to CPU memory; the losses must match (measured: bit-identical, the swap is a
  byte copy and the step is the same torch AdamW on the same fp32 partitions);
* ``resume``: the nvme run's checkpoint-2 alone, resumed with ``hf_dist.auto_resume``: steps 3-4 must repeat;
* ``planted``: the same checkpoint with a payload in every rank's optimizer file, resumed under ``attach``: refused.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dist.planning.nvme import param_swapper_bytes
from hf_dist.testing import cpu_env
from tests.distributed.conftest import launch_env

# the async_io op's build (about 3.5 min idle, several times that on a loaded 2-core machine) runs in the first test's
# fixture, whose time counts toward that test's limit: the module gets a limit that fits it
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(2400)]

STEPS, SAVE_STEPS, VOCAB, SEQ_LEN = 4, 2, 8192, 32
LOSS_RTOL = 1e-6  # measured 0.0; a step that lost its swapped state (fresh moments, stale master) moves far more
LAUNCH_TIMEOUT_S = 300
BUILD_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def async_io_op():
    """DeepSpeed's async_io op, JIT-built once; skipped, saying why, only where libaio is missing."""
    probe = "from deepspeed.ops.op_builder import AsyncIOBuilder as B; print(bool(B().is_compatible(verbose=False)))"
    out = subprocess.run([sys.executable, "-c", probe], env=cpu_env(), capture_output=True, text=True, timeout=120)
    if out.stdout.strip().splitlines()[-1:] != ["True"]:
        pytest.skip(
            "libaio is missing, so DeepSpeed's async_io op cannot be built: install libaio-dev (apt) or "
            "libaio-devel (dnf/yum); `make test` installs it where apt-get runs as root"
        )
    build = "from deepspeed.ops.op_builder import AsyncIOBuilder as B; B().load(verbose=False)"
    subprocess.run([sys.executable, "-c", build], env=cpu_env(), check=True, timeout=BUILD_TIMEOUT_S)


# the launches' runs (scripts/runs.py): the two offload devices in one, then both resumes of the nvme run's
# checkpoint-2 in one
GROUPS = (("nvme", "cpu"), ("resume", "planted"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, async_io_op):
    """name -> the run's report, each launch once; a failed launch is cached and re-raised by every test that needs
    one of its runs (never relaunched into the folder it left behind)."""
    done: dict[str, dict | BaseException] = {}

    def get(name: str) -> dict:
        if name not in done:
            (group,) = [g for g in GROUPS if name in g]
            try:
                done.update(launch({n: tmp_path_factory.mktemp(n) for n in group}, done))
            except Exception as exc:  # cached: the dependent tests fail with it instead of cascading
                done.update(dict.fromkeys(group, exc))
        result = done[name]
        if isinstance(result, BaseException):
            raise RuntimeError(f"launch of {name!r} failed (cached): {result}") from result
        return result

    return get


def launch(workdirs: dict, done: dict) -> dict:
    from tests.distributed.conftest import torchrun_runs

    runs, outputs = [], []
    for name, workdir in workdirs.items():
        device = "cpu" if name == "cpu" else "nvme"
        nvme, run, out = workdir / "nvme", workdir / "run", workdir / "report.json"
        nvme.mkdir(parents=True)
        args = ["--strategy", "zero3", "--offload", "optimizer+params", "--offload-device", device]
        args += ["--nvme-path", nvme, "--vocab-size", VOCAB, "--steps", STEPS, "--save-steps", SAVE_STEPS]
        args += ["--output-dir", run, "--out", out]
        if name in ("resume", "planted"):  # the nvme run's first checkpoint alone, as if the job had died after it
            source = done["nvme"]
            if isinstance(source, BaseException):
                raise RuntimeError("the nvme launch these resumes start from failed") from source
            # resume: auto_resume finds it in its output folder; planted: a payload in it, resumed as given
            into = run if name == "resume" else workdir / "source"
            shutil.copytree(source["output_dir"] + f"/checkpoint-{SAVE_STEPS}", into / f"checkpoint-{SAVE_STEPS}")
            args += ["--resume"] if name == "resume" else ["--resume-from", plant_every_rank(into, workdir)]
        runs.append(["strategies_train", *map(str, args)])
        outputs += [run, nvme]
    spec = next(iter(workdirs.values())) / "runs.json"
    torchrun_runs(runs, spec, env=launch_env("zero3"), outputs=outputs)
    return {
        name: {**json.loads((wd / "report.json").read_text()), "output_dir": str(wd / "run"), "nvme_path": str(wd / "nvme"),
               "workdir": str(wd)}
        for name, wd in workdirs.items()
    }  # fmt: skip


def plant_every_rank(folder: Path, workdir: Path) -> Path:
    """A payload in every rank's optimizer file of the copied checkpoint, in the zip that torch and Python's zipfile
    read differently; the run resumes it under attach alone, with no early check."""
    from tests.unit.checkpoint.safety.payloads import plant

    checkpoint = folder / f"checkpoint-{SAVE_STEPS}"
    for file in sorted(checkpoint.glob("global_step*/*optim_states.pt")):
        plant(file, workdir / "PAYLOAD_RAN", "two directories")
    return checkpoint


def modelled():
    """What the memory model counts for the launches (2 CPU ranks, fp32, ZeRO-Infinity with hf_dist's settings)."""
    from hf_dist.embedded.model import tiny_llama_config
    from hf_dist.planning.memory import estimate_memory

    return estimate_memory(
        tiny_llama_config(vocab_size=VOCAB), "zero3", 2, offload="optimizer+params", offload_device="nvme",
        param_bytes=4, master_weights=False, seq_len=SEQ_LEN, micro_batch_size=2, device="cpu",
    )  # fmt: skip


def test_zero_infinity_really_ran(runs):
    report = runs("nvme")
    assert (report["world_size"], report["distributed_type"], report["zero_stage"]) == (2, "DEEPSPEED", 3)
    assert (report["zero_offload_optimizer"], report["zero_offload_param"]) == ("nvme", "nvme")
    assert report["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"


def test_optimizer_state_lives_in_swap_files_not_host_memory(runs):
    steps = runs("nvme")["nvme"]
    assert sorted(map(int, steps)) == list(range(1, STEPS + 1))
    for step, facts in steps.items():
        swapped, small = facts["master_numel_per_group"]  # the decay group, the norms' group (under 1 MiB)
        assert swapped * 4 >= 2**20 > small * 4
        # after every step only the norms' fp32 partition and its two Adam moments are in memory
        assert facts["resident_master_numel"] == small, f"step {step}: {facts}"
        assert facts["resident_state_numel"] == 2 * small, f"step {step}: {facts}"


def test_swap_files_have_the_sizes_the_plan_counts(runs):
    files = runs("nvme")["nvme"][str(STEPS)]["swap_files"]
    gradients = sum(size for path, size in files.items() if "gradient" in path)
    params = sum(size for path, size in files.items() if "params/" in path)
    # fp32 master + 2 fp32 Adam moments of the swapped sub-group, and the fp32 gradients of the embedding and the head,
    # the only tensors whose partition reaches DeepSpeed's 1 MiB swap threshold here (8192 x 64 / 2 ranks x 4 B).
    # Their parameter partitions swap too where the parameter swapper keeps the fp32 dtype (a CPU with fp16 kernels);
    # in its bf16 (other CPUs: DeepSpeed's zero.Init picks it there) they stay under the threshold
    assert gradients == 2 * 2**20, files
    assert params == (2 * 2**20 if param_swapper_bytes("cpu", 4) == 4 else 0), files
    assert math.isclose(sum(files.values()), modelled().swap, rel_tol=0.01), (files, modelled().swap)


def test_losses_match_the_cpu_offload_run(runs):
    nvme, cpu = runs("nvme"), runs("cpu")
    assert (cpu["zero_offload_optimizer"], cpu["zero_offload_param"]) == ("cpu", "cpu")
    assert len(nvme["losses"]) == STEPS and nvme["losses"][-1] < nvme["losses"][0]
    for a, b in zip(nvme["losses"], cpu["losses"], strict=True):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (nvme["losses"], cpu["losses"])


def test_checkpoint_holds_the_swapped_state_and_converts(runs, tmp_path, capsys):
    from safetensors.torch import load_file

    from hf_dist.checkpoint.conversion.convert import convert
    from hf_dist.cli.main import main

    checkpoint = f"{runs('nvme')['output_dir']}/checkpoint-{STEPS}"
    tag = f"{checkpoint}/global_step{STEPS}"
    for rank in (0, 1):
        swapped = sorted(p.name for p in Path(f"{tag}/offloaded_tensors/rank{rank:02d}").iterdir())
        assert len(swapped) == 3 and all(name.endswith(".tensor.swp") for name in swapped), swapped
    out = tmp_path / "hf"
    assert main(["convert", checkpoint, str(out)]) == 0
    # no manifest (the run was not under attach): every master read from the swap files was compared with the weights
    # the Trainer gathered at the same save
    checked = [line for line in capsys.readouterr().out.splitlines() if line.startswith("checked: ")]
    assert len(checked) == 1 and "equal the weights the Trainer gathered" in checked[0], checked
    converted, gathered = load_file(out / "model.safetensors"), load_file(f"{checkpoint}/model.safetensors")
    assert converted.keys() == gathered.keys()
    for name, tensor in gathered.items():  # the fp32 masters read from the swap files, bit-equal
        assert converted[name].equal(tensor), name

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == VOCAB
    # a copy without one rank's swap files cannot be converted, and says which file is missing
    partial = tmp_path / "partial"
    shutil.copytree(checkpoint, partial)
    shutil.rmtree(partial / f"global_step{STEPS}" / "offloaded_tensors" / "rank01")
    with pytest.raises(
        FileNotFoundError, match=r"ZeRO-Infinity swapped it to NVMe\) and .*rank01/.*\.tensor\.swp is missing"
    ):
        convert(partial, tmp_path / "hf2", progress=False)


def test_auto_resume_continues_from_the_swapped_state(runs):
    nvme, resumed = runs("nvme"), runs("resume")
    assert resumed["resumed_from"].endswith(f"checkpoint-{SAVE_STEPS}")
    assert len(resumed["losses"]) == STEPS - SAVE_STEPS
    for a, b in zip(resumed["losses"], nvme["losses"][SAVE_STEPS:], strict=True):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (resumed["losses"], nvme["losses"])


def _swap_file(checkpoint: Path) -> Path:
    return sorted((checkpoint / f"global_step{STEPS}" / "offloaded_tensors" / "rank01").iterdir())[0]


def test_a_truncated_or_altered_swap_file_never_reaches_deepspeed(runs, tmp_path):
    """Swap files are trusted by content, not length: with the manifest hf_dist's callbacks write, an altered file is
    refused by auto_resume and convert, naming it; without one, a truncated file is refused by the layout's proof
    (the length its partition needs), never handed to DeepSpeed."""
    from hf_dist.checkpoint.conversion.convert import convert
    from hf_dist.checkpoint.conversion.gathered import GatheredCopyMismatch
    from hf_dist.checkpoint.formats.names import MANIFEST_NAME
    from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
    from hf_dist.checkpoint.safety.errors import CorruptCheckpointError
    from tests.unit.checkpoint.fakes import seal

    source = Path(runs("nvme")["output_dir"]) / f"checkpoint-{STEPS}"
    truncated = tmp_path / "truncated" / source.name
    shutil.copytree(source, truncated)
    swap = _swap_file(truncated)
    swap.write_bytes(swap.read_bytes()[:-4096])
    with pytest.raises(RuntimeError, match=rf"(?s)none can be proven complete.*{swap.name} holds .* bytes, less than"):
        auto_resume(truncated.parent, world_size=2)
    altered = tmp_path / "altered" / source.name
    shutil.copytree(source, altered)
    seal(altered, world_size=2, step=STEPS)  # what CompleteCheckpointCallback writes once every rank saved
    swap = _swap_file(altered)
    data = bytearray(swap.read_bytes())
    data[100:104] = b"\x7f\x7f\x7f\x7f" if data[100:104] != b"\x7f\x7f\x7f\x7f" else b"\x00\x00\x00\x00"
    swap.write_bytes(bytes(data))
    rel = swap.relative_to(altered).as_posix()
    with pytest.raises(RuntimeError, match=rf"(?s)none can be proven complete.*{rel} differs from the manifest"):
        auto_resume(altered.parent, world_size=2)
    with pytest.raises(CorruptCheckpointError, match=rf"does not match its hf_dist_complete.json: {rel} differs"):
        convert(altered, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()
    # without the manifest, the master read from the altered swap file differs from the weights the Trainer gathered
    # beside it at the same save: refused too (issue 38), where it converted silently before
    (altered / MANIFEST_NAME).unlink()
    with pytest.raises(GatheredCopyMismatch, match=r"read from the rank files differs from its copy in .*model"):
        convert(altered, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()


def test_a_zero_infinity_resume_refuses_a_planted_checkpoint(runs):
    """ZeRO-Infinity's resume (DeepSpeed's NVMe load, then hf_dist's repair of what it drops) under attach, with no
    early check: a payload in every rank's optimizer file (``plant_every_rank``) is refused on every rank, naming the
    file; it never runs."""
    report = runs("planted")
    assert report["refused"] == "UnsafePickleError", report
    assert "optim_states.pt: it names the global posix.mkdir" in report["message"]
    assert not (Path(report["workdir"]) / "PAYLOAD_RAN").exists()
