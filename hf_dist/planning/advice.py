"""What the planner says beyond its choice: a near miss of the safety margin, what Liger kernels or QLoRA would
change, and, when nothing fits, why and on how many GPUs it would."""

from __future__ import annotations

import math
from dataclasses import replace

from hf_dist.planning.activations import layer_activation_bytes
from hf_dist.planning.candidates import Setup, candidate, estimate
from hf_dist.planning.choice import TIE_FRACTION, best
from hf_dist.planning.dtypes import GIB, engine_dtypes
from hf_dist.planning.layout import OFFLOADS, REGISTRY
from hf_dist.planning.model_states import trainable_params
from hf_dist.planning.plan_result import Candidate, Combo, format_bytes


def near_miss(setup: Setup, candidates: list[Candidate], chosen: Candidate, safety_margin: float) -> str:
    """The fastest layout faster than ``chosen`` that misses the usable memory by less than 1 % of the card, with the
    safety margin that would take it; "" when there is none."""
    card = setup.hw.gpu_memory_gib * GIB
    close = [
        c for c in candidates
        if not c.fits and (c.tokens_per_s or 0) > (chosen.tokens_per_s or 0) and 0 < c.memory.total - setup.usable < 0.01 * card
    ]  # fmt: skip
    if not close:
        return ""
    c = max(close, key=lambda c: c.tokens_per_s or 0)
    needed = math.floor((1 - c.memory.total / card) * 1000) / 1000
    return (
        f"{c.label} misses the usable {setup.usable / GIB:.1f} GiB by {(c.memory.total - setup.usable) / GIB:.2f} GiB "
        f"(under 1 % of the card) and would run at ~{c.tokens_per_s:,.0f} vs ~{chosen.tokens_per_s:,.0f} tokens/s: it "
        f"fits with safety_margin={needed:g} (now {safety_margin:g}), if you trust the estimate that far"
    )


def chosen_dimensions(chosen: Candidate) -> list[str]:
    if chosen.model_parallel == 1 and chosen.offload_device != "nvme":
        return []
    return [f"chosen {chosen.label}: {chosen.reason.split('; ', 1)[-1]}"]


def liger_gain(s: Setup, chosen: Candidate) -> str:
    """What Liger kernels would change for the chosen layout, when the package is missing."""
    strategy = chosen.strategy
    options = [candidate(s, chosen.key._replace(ckpt=ckpt, liger=True)) for ckpt in (False, True)]
    fitting = [c for c in options if c.fits]
    if not fitting:
        return ""
    alt = best(fitting)
    gain = alt.tokens_per_s / chosen.tokens_per_s - 1
    if gain <= TIE_FRACTION:
        return ""
    return (
        f"not installed; with liger-kernel (pip install 'hf_dist[liger]') {strategy} would fit micro_batch "
        f"{alt.micro_batch_size}{' with checkpointing' if alt.activation_checkpointing else ''} at "
        f"{format_bytes(alt.memory.total)} and run ~{gain:.0%} faster (~{alt.tokens_per_s:,.0f} tokens/s)"
    )


def lora_without_offload(s: Setup, chosen: Candidate) -> str:
    """When a LoRA plan offloads: what QLoRA (a 4-bit base) or Liger's kernels would fit without offload, each
    with its speed; "" otherwise."""
    if s.method != "lora" or chosen.offload == "none" or s.hw.device != "cuda":
        return ""

    qlora = replace(s, method="qlora", trainable=trainable_params(s.spec, "qlora", s.lora))
    q_how = "QLoRA (method='qlora', a 4-bit base; bitsandbytes)"
    l_how = "Liger's kernels (use_liger_kernel=True" + (
        ")" if s.hw.liger_kernel else "; pip install 'hf_dist[liger]')"
    )
    ways = [(qlora, False, q_how)]
    if not chosen.use_liger_kernel:
        ways += [(s, True, l_how), (qlora, True, f"{q_how} with {l_how}")]
    ways = [(setup, chosen.key._replace(offload="none", ckpt=ckpt, liger=liger or chosen.use_liger_kernel), how)
            for setup, liger, how in ways for ckpt in (False, True)]  # fmt: skip
    notes = {}
    for setup, combo, how in ways:
        c = candidate(setup, combo)
        if c.fits and (how not in notes or (c.tokens_per_s or 0) > (notes[how].tokens_per_s or 0)):
            notes[how] = c
    offloaded = f" (offloaded: ~{chosen.tokens_per_s:,.0f} tokens/s)" if chosen.tokens_per_s else ""
    return "; ".join(
        f"{how} would fit without offload: micro_batch {c.micro_batch_size}"
        f"{' with checkpointing' if c.activation_checkpointing else ''} at {format_bytes(c.memory.total)}"
        + (f", ~{c.tokens_per_s:,.0f} tokens/s" if c.tokens_per_s else "")
        for how, c in notes.items()
    ) + (offloaded if notes else "")


def nothing_fits_message(s: Setup, combos, candidates: list[Candidate], dims: list[str]) -> str:
    """Why nothing fits and what would, one finding a line."""
    hw = s.hw
    model_parallel = [d for d in dims if not d.startswith("tp/cp/sp not searched")]
    batch = [c for c in candidates if c.reason.startswith(("global_batch", "micro_batch_size"))]
    if len(batch) == len(candidates):  # no layout can split the batch (or run its micro-batch): the arithmetic
        return _lines(candidates[0].reason, [f"model parallelism: {d}" for d in model_parallel])
    # the GPU memory that would suffice is stated for plans without offload (offload also needs host RAM)
    smallest = min([c for c in candidates if c.offload == "none"] or candidates, key=lambda c: c.memory.total)
    margin = s.usable / (hw.gpu_memory_gib * GIB)
    findings = []
    if smallest.memory.total > s.usable:
        findings.append(
            f"the smallest candidate ({smallest.label}, micro_batch={smallest.micro_batch_size}) needs "
            f"{format_bytes(smallest.memory.total)} per rank (usable {format_bytes(s.usable)}); it would fit with "
            f"{smallest.memory.total / margin / GIB:.0f} GiB per GPU"
        )
    for nvme in (False, True):  # the least host RAM any CPU / NVMe offload layout asks for
        host = [
            c for c in candidates
            if c.offload != "none" and "of host RAM per node" in c.reason and (c.offload_device == "nvme") == nvme
        ]  # fmt: skip
        if host:
            least = min(host, key=lambda c: c.memory.cpu)
            findings.append(f"with {'NVMe' if nvme else 'CPU'} offload ({least.label}) the {least.reason}")
    findings += [f"model parallelism: {d}" if not d.startswith("nvme:") else d for d in model_parallel]
    head = f"nothing fits on {hw.world_size} x {hw.gpu_memory_gib:.0f} GiB"
    if _needs_tensor_parallel(s):
        findings.append(
            f"a single decoder layer ({s.spec.layer_params / 1e6:.0f}M params) with its gradients and activations "
            "does not fit on one GPU even with full sharding: it needs tensor parallelism (above) or, beyond one "
            "node's GPUs, pipeline parallelism (not covered by hf_dist)"
        )
        return _lines(head, findings)
    fully_sharded = [c for c in combos if REGISTRY[c[0]].shards.params and not REGISTRY[c[0]].gathers_params]
    found = _min_world(s, fully_sharded or combos)
    if found is None:
        findings.append("no data-parallel world size up to 8192 GPUs fits: use tensor/pipeline parallelism")
    else:
        world, nodes, combo = found
        findings.append(
            f"it would fit on at least {world} GPUs of {hw.gpu_memory_gib:.0f} GiB ({nodes} node(s)) with {combo[0]}, "
            f"offload={combo[1]}, activation_checkpointing={combo[2]}"
        )
    return _lines(head, findings)


def _lines(head: str, findings: list[str]) -> str:
    """``head:`` and one ``  - finding`` a line (``head`` alone without findings)."""
    return head + ":" + "".join(f"\n  - {f}" for f in findings) if findings else head


def _needs_tensor_parallel(s: Setup) -> bool:

    if not s.spec.has_shape:
        return False
    lay = engine_dtypes(REGISTRY["fsdp_full_shard"], s.pb, s.master, s.method, s.base_bytes)
    trainable_layer = s.spec.layer_params if s.method == "full" else 0
    layer = s.spec.layer_params * s.pb + trainable_layer * lay.grads
    acts = layer_activation_bytes(s.spec, s.seq_len, 1, lay)
    return layer + acts > s.usable


def _min_world(s: Setup, combos) -> tuple[int, int, tuple] | None:
    """Smallest world size (same GPUs per node; nodes of 8 beyond one node) on which a combo fits at micro_batch 1."""
    per_node = max(s.hw.gpus_per_node, 8)
    sizes = [(w, 1) for w in range(s.hw.world_size + 1, per_node + 1)]
    sizes += [(per_node * k, k) for k in range(2, 8192 // per_node + 1)]
    for level in OFFLOADS:  # the fewest GPUs without offload if possible, else with the least offload
        smallest = None
        for combo in (c for c in combos if c[1] == level):
            # memory per rank only falls as the world grows, so bisect over the ordered sizes
            if not sizes or not _fits_at(s, combo, sizes[-1]):
                continue
            lo, hi = 0, len(sizes) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if _fits_at(s, combo, sizes[mid]):
                    hi = mid
                else:
                    lo = mid + 1
            if smallest is None or lo < smallest[0]:
                smallest = (lo, combo)
        if smallest is not None:
            return sizes[smallest[0]][0], sizes[smallest[0]][1], smallest[1]
    return None


def _fits_at(s: Setup, combo: Combo, size: tuple[int, int]) -> bool:
    world, nodes = size
    if nodes < REGISTRY[combo[0]].min_nodes:
        return False
    return estimate(s, combo, 1, world=world, nodes=nodes).total <= s.usable
