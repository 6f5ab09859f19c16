"""The dry run's text of a plan: its sections that say what the run will be — the layout, the training
recipe, the hardware with the source of every value, the time estimate with the figures it used — and
:func:`format_plan`, which puts them together with the memory table, the stages, the problems and the job
scripts (what ``dry_run=true`` prints)."""

from __future__ import annotations

import textwrap
from math import inf

from orchestrator.base.estimate import (
    DEVICE_HOURS,
    NO_MEMORY,
    NO_TIME,
    exchange_gbps,
    fmt_duration,
    memory_table,
    options_table,
    pipeline_gbps,
)
from orchestrator.base.hardware import hardware, is_cpu, source
from orchestrator.base.layout import Layout
from orchestrator.base.measured import measured_recipes
from orchestrator.base.plan_types import Plan
from orchestrator.base.schema import SlipwayConfig
from orchestrator.planning.autolayout import proposal_lines
from orchestrator.planning.data_shares import corpus_shares, shares_table
from orchestrator.stages import get as stage_def
from orchestrator.stages import preprocess
from orchestrator.stages.train import NAME as TRAIN
from trainer.config.train import PRECISION_FACTS, precision_recipe, recipe_line
from trainer.run_files import RunDir


def layout_line(cfg: SlipwayConfig, lay: Layout) -> str:
    head = (f"  layout: {lay.nodes} node(s) × {lay.tasks_per_node} task(s) = world {lay.world} = "
            f"tp {lay.tp} × pp {lay.pp} × dp {lay.dp}")
    if not lay.dp:
        return f"{head}: no valid split of the world (see PROBLEMS)"
    if not lay.num_microbatches:
        return f"{head}: the global batch {lay.global_batch} does not split into micro-batches (see PROBLEMS)"
    return f"{head}; {lay.num_microbatches} micro-batch(es) of {cfg.train.micro_batch_size} per step"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,.0f}"


def recipe_lines(cfg: SlipwayConfig, lay: Layout, vocab: int) -> list[str]:
    """The training recipe the run will follow, so a wrong one is seen before the queue."""
    o, t, m = cfg.optim, cfg.train, cfg.model
    decay = o.decay_iters if o.decay_iters is not None else t.iters
    tokens_per_step = lay.global_batch * m.seq_length
    return [
        f"  recipe: lr {o.lr:g} → min_lr {o.min_lr:g}, {o.warmup_iters} warm-up iterations, {o.decay_style} "
        f"decay to iteration {decay}; AdamW β {o.adam_beta1:g}/{o.adam_beta2:g}, weight decay "
        f"{o.weight_decay:g}, clip {o.clip_grad:g}",
        f"          global batch {lay.global_batch} × seq {m.seq_length} = {tokens_per_step:,} tokens per "
        f"step, {t.iters} iterations = {_count(tokens_per_step * t.iters)} tokens, precision "
        f"{t.precision}, vocab {vocab}",
    ]


def _row(name: str, value: str, where: str) -> str:
    return f"  {name:<18}{value:<26}{where}"


def hardware_lines(cfg: SlipwayConfig) -> list[str]:
    """Each hardware value the plan used and where it came from (site file, experiment, command line,
    default, the device table, the measured MFU)."""
    c, hw = cfg.cluster, hardware(cfg)
    site = c.hardware_sources.get("site", f"cluster {c.name}")
    nodes = f"{c.nodes}" + (f" (of {c.max_nodes})" if c.max_nodes is not None else "")
    lines = [f"Hardware ({site}; an experiment asks for a size, the site file states the hardware):",
             _row("nodes", nodes, source(c, "nodes"))]
    if c.gpus_per_node:
        lines.append(_row("GPUs per node", str(c.gpus_per_node), source(c, "gpus_per_node")))
    for key, name, unit in (("cpus_per_node", "CPUs per node", ""), ("mem_per_node_gb", "memory per node",
                                                                       " GB")):
        if getattr(c, key) is not None:
            lines.append(_row(name, f"{getattr(c, key):g}{unit}", source(c, key)))
    device = c.device_name + (f" = {hw.gpu.name}" if hw.gpu and hw.gpu.name != c.device_name else "")
    memory = f"{hw.memory_gb.value:g} GB" if hw.memory_gb.value else "unknown"
    peak = f"{hw.peak_tflops.value:g} TFLOP/s" if hw.peak_tflops.value else "unknown"
    lines += [_row("device", device, source(c, "device_name")),
              _row("device memory", memory, hw.memory_gb.source),
              _row(f"peak ({cfg.train.precision})", peak, hw.peak_tflops.source)]
    if not is_cpu(c):
        lines += [_row("bf16", "yes" if hw.bf16.value else "no", hw.bf16.source),
                  _row("bus bandwidth", f"{c.bus_bandwidth_gbps:g} GB/s", source(c, "bus_bandwidth_gbps")),
                  _row("within a node", f"{hw.intra_node_gbps.value:g} GB/s", hw.intra_node_gbps.source)]
    lines.append(_row("MFU for the ETA", f"{hw.mfu.value:.1%}" + (" (at saturation)" if hw.mfu_size == inf
                                                                   and hw.efficiency.value else ""),
                      hw.mfu.source))
    curve, h, tp = hw.efficiency.value, cfg.model.hidden_size, max(cfg.parallel.tp_size, 1)
    half = f"half at {curve.tokens_at_half(h, tp):,.0f} tokens" if curve else "none"
    lines.append(_row("by micro-batch", half, (f"hidden {h}, tp {tp}: " if curve else "")
                      + hw.efficiency.source))
    return lines


def precision_notes(cfg: SlipwayConfig, recipes: frozenset[str] | None = None) -> list[str]:
    """What the plan says of the precision on this device, from the one table of facts (PRECISION_FACTS)
    and what bench/ measured (``recipes``: the recipes a GPU run used, orchestrator/base/measured.py)."""
    if not cfg.cluster.gpus_per_node:
        return []
    t, hw, out = cfg.train, hardware(cfg), []
    facts = PRECISION_FACTS.get(t.precision)
    if facts is not None and facts.loss_scaling and hw.bf16.value:
        device = hw.gpu.name if hw.gpu else cfg.cluster.device_name
        out.append(f"{t.precision} is the usual choice on {facts.where}; {device} has bf16, the usual choice "
                   f"on {PRECISION_FACTS['bf16'].where}: train.precision=bf16")
    recipe = precision_recipe(t.precision, t.precision_recipe, cfg.optim.distributed)
    measured = measured_recipes() if recipes is None else recipes
    if recipe not in measured:
        out.append(f"the {recipe} recipe has not been measured on a GPU yet (bench/results/mfu.json: "
                   f"{', '.join(sorted(measured)) or 'nothing'}): its speed, and the ETA's MFU, are another "
                   "recipe's figures")
    return [line for n in out for line in textwrap.wrap(f"note: {n}", 106, initial_indent="    ",
                                                          subsequent_indent="      ")]


def wandb_lines(cfg: SlipwayConfig, plan: Plan) -> list[str]:
    """Where the run logs: W&B's mode, project, entity, group and run name as the training job gets them
    (the train stage's trainer config: a sweep's id is its group), and where the API key comes from —
    never the key."""
    w = cfg.logging.wandb
    if w.mode == "disabled":
        return ["  W&B: disabled (logging.wandb.mode)"]
    job = next((s.job for s in plan.stages if s.name == TRAIN), None)
    given = getattr(job, "trainer_config", {}).get("logging", {}).get("wandb", {}) if job else {}
    group, name = given.get("group", w.group), given.get("name", w.name)
    entity = w.entity or "(the key's default)"
    where = (f"  W&B: {w.mode}, project {w.project}, entity {entity}, group {group or '(none)'}, run "
             f"{name or plan.run_id}")
    if w.mode == "offline":
        return [where, f"       files under {RunDir(plan.run_dir).wandb} (wandb sync uploads them); no key "
                       "needed"]
    if plan.wandb_key is None:
        key = "none found (WANDB_API_KEY unset, no netrc entry): see PROBLEMS"
    elif plan.wandb_key == "WANDB_API_KEY":
        key = "WANDB_API_KEY of the launching environment (the jobs inherit it)"
    else:
        key = f"netrc file {plan.wandb_key} (wandb login)"
    return [where, f"       API key: {key}"]


def memory_lines(cfg: SlipwayConfig, plan: Plan) -> list[str]:
    """The memory table and the options beside it, or why there is none (the model's sizes are broken)."""
    if plan.memory is NO_MEMORY:
        return ["Memory: not estimated: the model or layout has problems (see PROBLEMS)"]
    table = memory_table(plan.memory, cfg.cluster.device_name)
    return ["Memory per device (the busiest pipeline stage):", table,
            *options_table(plan.memory, plan.memory_options)]


def time_lines(cfg: SlipwayConfig, plan: Plan) -> list[str]:
    """The time estimate, or why there is none (a layout or device problem): never an ETA from nonsense."""
    lay, t, hw = plan.layout, plan.time, hardware(cfg)
    if not lay.dp or not lay.num_microbatches or plan.time is NO_TIME:
        return ["Time: not estimated: the model or layout has problems (see PROBLEMS)"]
    if not t.known:
        return [f"Time: not estimated: the device's peak is unknown ({hw.peak_tflops.source}; see PROBLEMS)"]
    comm = []
    if t.tp_comm_s:
        comm.append(f"tensor-parallel all-reduces {t.tp_comm_s:.3g} s (at {hw.intra_node_gbps.value:g} GB/s)")
    if t.p2p_s:
        comm.append(f"pipeline transfers {t.p2p_s:.3g} s (at {pipeline_gbps(cfg, lay):g} GB/s)")
    if t.exchange_s:
        comm.append(f"data-parallel exchange {t.exchange_s:.3g} s ({t.exposed_s:.3g} s of it not hidden "
                    f"behind backward, at {exchange_gbps(cfg, lay):g} GB/s)")
    scaled = ""
    if f"{t.mfu:.1%}" != f"{hw.mfu.value:.1%}":  # the efficiency curve's share at this micro-batch
        split = f", split over tp {lay.tp}" if lay.tp > 1 else ""
        mb, seq = cfg.train.micro_batch_size, cfg.model.seq_length
        share = t.mfu / hw.mfu.value
        scaled = f" ({hw.mfu.value:.1%} × {share:.2f} at micro-batch {mb} × {seq} tokens{split})"
    return [
        f"Time: {t.flops_per_iter / 1e12:.1f} TFLOP per iteration; at {t.mfu:.1%} MFU{scaled} of "
        f"{hw.peak_tflops.value:g} TFLOP/s per device, pipeline bubble {t.bubble_fraction:.0%}"
        + "".join(f", {c}" for c in comm) + f": {t.step_s:.3f} s/iteration",
        f"  ETA {fmt_duration(t.eta_s)}, {t.device_hours:.1f} {DEVICE_HOURS} ({cfg.cluster.device_name} × "
        f"{lay.world}); first checkpoint after {fmt_duration(t.first_checkpoint_s)}",
    ]


def _data_prefixes(plan: Plan) -> list[str]:
    return preprocess.prefixes(plan.stage(preprocess.NAME).job)


def format_plan(cfg: SlipwayConfig, plan: Plan, scripts: dict[str, str]) -> str:
    lay = plan.layout
    precision = recipe_line(cfg.train.precision, cfg.train.precision_recipe, cfg.optim.distributed)
    lines = [f"Slipway plan: experiment {plan.experiment}, run {plan.run_id}", f"  run dir: {plan.run_dir}"]
    if plan.sweep:
        lines.append(
            f"  sweep {plan.sweep.sweep_id} point {plan.sweep.point}: {' '.join(plan.sweep.overrides)}"
        )
    lines += [
        layout_line(cfg, lay),
        *(proposal_lines(cfg, plan.proposal) if plan.proposal is not None else []),
        *recipe_lines(cfg, lay, plan.vocab_size),
        f"  precision recipe: {precision}",
        *precision_notes(cfg),
        *wandb_lines(cfg, plan),
        *shares_table(corpus_shares(cfg, lay.global_batch, _data_prefixes(plan))),
        "",
        *hardware_lines(cfg),
        "",
        *memory_lines(cfg, plan),
        "",
        *time_lines(cfg, plan),
        "",
        "Stages:",
    ]
    for s in plan.stages:
        where = "shared cache" if s.shared else "run dir"
        deps = f" after {', '.join(s.depends_on)}" if s.depends_on else ""
        lines.append(f"  {s.name:<11} key {s.key}  {s.state_dir} ({where}){deps}")
        done = stage_def(s.name).complete(s)  # what a launch would not submit again (submit.py)
        lines += [f"              no job: {done}"] if done else []
    if plan.warnings:
        lines += ["", "Warnings:", *(f"  - {w}" for w in plan.warnings)]
    if plan.problems:
        lines += ["", f"PROBLEMS ({len(plan.problems)}) — nothing would be submitted:"]
        lines += [f"  - {p}" for p in plan.problems]
    for name, text in scripts.items():
        lines += ["", f"----- {name} job script -----", text.rstrip()]
    return "\n".join(lines) + "\n"
