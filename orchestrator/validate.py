"""Everything knowable on the login node, checked before any job exists.

Each check returns :class:`Problem` records naming the key, the value, and the fix; :func:`validate`
collects all of them so the user fixes a config in one round, not one error per queue wait. The checks
are pure functions of the typed config (plus an injectable ``exists`` for the file checks).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.container import (
    CREDENTIALS,
    MOUNT_UNSAFE,
    REGISTRY_REF,
    SYSTEM_DIRS,
    image_is_file,
    mount_points,
)
from orchestrator.layout import Layout, layout_of
from orchestrator.redaction import redact
from orchestrator.schema import SlipwayConfig
from trainer.checks import ConfigIssue
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE
from trainer.run_files import RUN_JSON


@dataclass(frozen=True)
class Problem(ConfigIssue):
    """One configuration error (the trainer's :class:`ConfigIssue` record): ``code`` is its class (stable,
    used by tests), the rest is for people."""

    def __str__(self) -> str:
        # Secrets in the config are reported as "<redacted>" (guards.py); redact() also hides any other
        # value that looks like one (a token pasted into a path), so a refusal never prints a secret.
        return redact(super().__str__())


class PlanError(ValueError):
    """Raised instead of submitting when any problem was found; lists all of them."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        lines = "\n  - ".join(str(p) for p in problems)
        super().__init__(f"{len(problems)} configuration problem(s); nothing was submitted:\n  - {lines}")


def _section_problems(cfg: SlipwayConfig) -> list[Problem]:
    """Each section's own rules, defined once beside its fields (trainer/config, orchestrator/schema)."""
    return [Problem(i.code, i.key, i.value, i.message, i.fix) for i in cfg.problems()]


def _divisibility(cfg: SlipwayConfig, lay: Layout) -> list[Problem]:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    out = []
    if p.tp_size > 0 and m.num_attention_heads % p.tp_size:
        out.append(
            Problem(
                "tp_heads",
                "parallel.tp_size",
                p.tp_size,
                f"model.num_attention_heads={m.num_attention_heads} is not divisible by it",
                "choose a tp_size that divides the number of heads",
            )
        )
    # Grouped-query attention: tp must divide the KV groups too (the model section's own rule).
    out += [Problem(i.code, i.key, i.value, i.message, i.fix) for i in m.tp_issues(p.tp_size)
            if i.code == "tp_num_query_groups" and m.query_groups != m.num_attention_heads]
    # pp_size must divide the layers: RunConfig.problems() (ModelConfig.pp_issues), reported with the
    # sections' own problems.
    if lay.dp == 0 and p.tp_size > 0 and p.pp_size > 0:
        out.append(
            Problem(
                "world",
                "cluster.nodes",
                cfg.cluster.nodes,
                f"world = nodes {lay.nodes} × tasks_per_node {lay.tasks_per_node} = {lay.world} is not a "
                f"multiple of tp {p.tp_size} × pp {p.pp_size} = {p.tp_size * p.pp_size}",
                "change cluster.nodes / cluster.gpus_per_node (or cluster.tasks_per_node) or the tp/pp sizes",
            )
        )
    elif lay.dp and lay.num_microbatches == 0 and t.micro_batch_size > 0:
        need = t.micro_batch_size * lay.dp
        out.append(
            Problem(
                "batch",
                "train.global_batch_size",
                t.global_batch_size,
                f"not divisible by micro_batch_size {t.micro_batch_size} × dp {lay.dp} = {need}",
                f"use a multiple of {need}, e.g. {max(need, (t.global_batch_size // need) * need)}",
            )
        )
    out += _virtual_pipeline(cfg, lay)
    if p.sequence_parallel and p.tp_size < 2:
        out.append(
            Problem(
                "sequence_parallel",
                "parallel.sequence_parallel",
                True,
                "sequence parallelism splits along the tensor-parallel group, which has size 1",
                "set parallel.sequence_parallel=false or parallel.tp_size>1",
            )
        )
    return out


def _virtual_pipeline(cfg: SlipwayConfig, lay: Layout) -> list[Problem]:
    """The interleaved schedule's constraints (Megatron's): equal chunks of layers, and micro-batches in
    groups of pp_size (the schedule runs each chunk on a group of p micro-batches in turn). v > 1 with
    pp_size 1 is ParallelConfig's own problem."""
    m, p, v, out = cfg.model, cfg.parallel, cfg.parallel.virtual_pp_size, []
    if not isinstance(v, int) or v < 2 or p.pp_size < 2:
        return out
    if m.num_layers % (p.pp_size * v):
        fit = [k for k in range(2, v + 3) if m.num_layers % (p.pp_size * k) == 0]
        out.append(Problem("vpp_layers", "parallel.virtual_pp_size", v,
                           f"model.num_layers={m.num_layers} is not divisible by pp_size·virtual_pp_size = "
                           f"{p.pp_size}·{v} = {p.pp_size * v} (each model chunk needs equal layers)",
                           f"use parallel.virtual_pp_size={fit[0]}" if fit else
                           "use parallel.virtual_pp_size=1, or a num_layers divisible by "
                           "pp_size·virtual_pp_size"))
    if lay.num_microbatches and lay.num_microbatches % p.pp_size:
        need = cfg.train.micro_batch_size * lay.dp * p.pp_size
        out.append(Problem("vpp_microbatches", "train.global_batch_size", cfg.train.global_batch_size,
                           f"gives {lay.num_microbatches} micro-batches per step, not a multiple of "
                           f"parallel.pp_size={p.pp_size} as the interleaved schedule needs",
                           f"use a multiple of micro_batch_size × dp × pp_size = {need}, e.g. "
                           f"{max(need, (lay.global_batch // need) * need)}, or parallel.virtual_pp_size=1"))
    return out


def _warmup(cfg: SlipwayConfig) -> list[Problem]:
    """Warm-up longer than the default decay length (train.iters); with optim.decay_iters set,
    OptimConfig checks this itself."""
    o, t = cfg.optim, cfg.train
    if o.decay_iters is None and o.warmup_iters > t.iters:
        return [Problem("warmup", "optim.warmup_iters", o.warmup_iters, f"exceeds the decay length {t.iters}",
                        "lower optim.warmup_iters")]
    return []


def _precision(cfg: SlipwayConfig) -> list[Problem]:
    prec, c = cfg.train.precision, cfg.cluster
    if prec == "fp16" and c.gpus_per_node == 0:
        return [
            Problem(
                "precision",
                "train.precision",
                prec,
                f"fp16 mixed precision needs CUDA; cluster.{c.name} has no GPUs",
                "use train.precision=fp32 (or bf16) on CPU clusters",
            )
        ]
    if prec == "bf16" and not c.device_bf16:
        return [
            Problem(
                "precision",
                "train.precision",
                prec,
                f"cluster device {c.device_name} has no bf16 support (cluster.device_bf16=false)",
                "use train.precision=fp16 on pre-Ampere GPUs",
            )
        ]
    return []


def _cluster(cfg: SlipwayConfig) -> list[Problem]:
    c, out = cfg.cluster, []
    if c.executor == "local" and c.nodes != 1:
        out.append(
            Problem(
                "local_nodes",
                "cluster.nodes",
                c.nodes,
                "the local executor runs on one machine",
                "use cluster.nodes=1, or cluster=devcluster / cluster=slurm for several nodes",
            )
        )
    backend = c.backend or ("nccl" if c.gpus_per_node else "gloo")
    if backend == "nccl" and c.gpus_per_node == 0:
        out.append(
            Problem(
                "backend",
                "cluster.backend",
                backend,
                "NCCL needs GPUs; this cluster has none",
                "set cluster.backend=gloo (or null)",
            )
        )
    if c.signal_delay_s >= c.time_limit_min * 60:
        out.append(
            Problem(
                "signal_lead",
                "cluster.signal_delay_s",
                c.signal_delay_s,
                f"not shorter than the time limit ({c.time_limit_min} min)",
                "lower cluster.signal_delay_s or raise cluster.time_limit_min",
            )
        )
    return out


_BUILD = {"apptainer": "containers/build.sh and set container.image=/path/slipway-ngc.sif",
          "pyxis": "containers/build_sqsh.sh and set container.image=/path/slipway-ngc.sqsh"}


def _container(cfg: SlipwayConfig) -> list[Problem]:
    """The image and the folders the runtime binds (what they are: orchestrator/container.py)."""
    c, out = cfg.container, []
    if c.kind not in _BUILD:
        return out
    if not c.image:
        out.append(Problem("container_image", "container.image", None, f"{c.kind} needs an image",
                           f"build one with {_BUILD[c.kind]}"))
    if c.kind == "pyxis":
        out += _pyxis(cfg)
    unsafe, chars = MOUNT_UNSAFE[c.kind]
    for key, path in mount_points(cfg):
        if unsafe.search(path):
            out.append(Problem("container_mount", key, path, f"{c.kind} binds it into the image, and its "
                               f"list of binds cannot hold a path with {chars}",
                               f"use a path without {chars} (a symlink to it will do)"))
        elif path in SYSTEM_DIRS:
            out.append(Problem("container_mount", key, path, f"{c.kind} would bind it over the image's own "
                               f"{path} (its CUDA, Python and libraries)",
                               "use a folder of its own, e.g. /shared/<project>/slipway"))
    return out


def _pyxis(cfg: SlipwayConfig) -> list[Problem]:
    image, out = cfg.container.image, []
    if cfg.cluster.executor == "local":
        out.append(Problem("container_local", "container.kind", "pyxis",
                           "pyxis runs containers through srun (--container-image); the local executor "
                           "starts this machine's processes without srun",
                           "use container=none (or container=apptainer_ngc) with cluster=local, or a Slurm "
                           "cluster whose srun has pyxis"))
    if not image or image_is_file(image):
        return out  # a file: file_missing and container_image_format check it
    if CREDENTIALS.match(image):
        out.append(Problem("container_image_credentials", "container.image", "<redacted>",
                           f"holds USER:PASSWORD@ (job scripts and {RUN_JSON} are written to disk)",
                           "keep only USER@ and put the password in enroot's credentials file "
                           "($ENROOT_CONFIG_PATH/.credentials, see enroot's import docs)"))
    elif not REGISTRY_REF.fullmatch(image):
        out.append(Problem("container_image_uri", "container.image", image,
                           "is neither a squashfs file (a path starting with / or ., or ending .sqsh) nor a "
                           "registry reference pyxis reads ([USER@][REGISTRY#]IMAGE[:TAG], lower-case image "
                           "name, optionally docker:// and @sha256:DIGEST)",
                           "write e.g. registry.example.org#team/slipway:1.0 or "
                           "/shared/images/slipway-ngc.sqsh"))
    return out


def _data(cfg: SlipwayConfig) -> list[Problem]:
    d, tok, out = cfg.data, cfg.tokenizer, []
    if d.corpus is None and not d.paths:
        out.append(
            Problem(
                "data_missing",
                "data.paths",
                [],
                "no input files and no corpus stage",
                "set data.paths=[/path/train.jsonl] or data=stdlib",
            )
        )
    if d.corpus is not None and d.paths:
        out.append(Problem("data_paths_ignored", "data.paths", list(d.paths),
                           "the corpus stage (data.corpus) builds this run's input, so these files would "
                           "be ignored", "to train on them set data.corpus=null (and tokenizer.vocab_file/"
                           "merge_file, or tokenizer.vocab_size to train one); otherwise drop data.paths"))
    if tok.type == HF_TOKENIZER_TYPE:  # tokenizer.model's own rules are TokenizerConfig.problems()
        return out
    if (tok.vocab_file is None) != (tok.merge_file is None):
        out.append(
            Problem(
                "tokenizer_pair",
                "tokenizer.merge_file",
                tok.merge_file,
                "vocab_file and merge_file go together",
                "set both, or neither to train one",
            )
        )
    if tok.vocab_file is None and d.corpus is None:
        out.append(
            Problem(
                "tokenizer_missing",
                "tokenizer.vocab_file",
                None,
                "no tokenizer files and no corpus stage to train one on",
                "set tokenizer.vocab_file and tokenizer.merge_file (or tokenizer=codeparrot)",
            )
        )
    if tok.vocab_file is None and not tok.vocab_size:
        out.append(
            Problem(
                "vocab_size",
                "tokenizer.vocab_size",
                tok.vocab_size,
                "needed to train a tokenizer",
                "set tokenizer.vocab_size, e.g. 2048",
            )
        )
    return out


def _evaluation(cfg: SlipwayConfig) -> list[Problem]:
    """The eval stage's rules that need other sections (its own are EvalConfig.problems())."""
    e, out = cfg.eval, []
    if not e.enabled or not cfg.convert.enabled:  # no conversion, no eval stage (the plan warns)
        return out
    if e.device == "cuda" and cfg.cluster.gpus_per_node == 0:
        out.append(Problem("eval_device", "eval.device", e.device,
                           f"cluster {cfg.cluster.name} has no GPUs (cluster.gpus_per_node=0)",
                           "set eval.device=cpu"))
    return out


# Names that become one path component (runs/<experiment>/<run_id>/) and job names: no separators, no
# "..", no spaces or shell characters, so they cannot escape runs_root or split a script's argument.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def _names(cfg: SlipwayConfig) -> list[Problem]:
    out = []
    for key, value in (("run_id", cfg.run_id), ("experiment", cfg.experiment)):
        if value is not None and (not SAFE_NAME.match(value) or ".." in value):
            out.append(Problem(
                "name", key, value,
                "becomes a folder name and part of job names: it may hold only letters, digits and '._+-' "
                "(at most 128, no '..', not starting with '.' or '-')",
                f"choose another {key}, e.g. {key}=20261202-lr3e-4"))
    return out


def check_files(cfg: SlipwayConfig, exists: Callable[[str], bool] = os.path.exists) -> list[Problem]:
    """Inputs the stages read must exist now (they are not produced by an earlier stage)."""
    out = []
    files = [] if cfg.data.corpus is not None else [("data.paths", p) for p in cfg.data.inputs()]
    files += [
        (k, v)
        for k, v in (
            ("tokenizer.vocab_file", cfg.tokenizer.vocab_file),
            ("tokenizer.merge_file", cfg.tokenizer.merge_file),
            ("tokenizer.model", cfg.tokenizer.model and os.path.join(cfg.tokenizer.model, "tokenizer.json")),
        )
        if v
    ]
    c = cfg.container
    if c.image and (c.kind == "apptainer" or (c.kind == "pyxis" and image_is_file(c.image))):
        files.append(("container.image", c.image))
    for key, path in files:
        if not exists(path):
            out.append(
                Problem(
                    "file_missing",
                    key,
                    path,
                    "file does not exist (as seen from this node)",
                    f"create it or point {key} at an existing file (paths must be on shared storage)",
                )
            )
    return out


def validate(cfg: SlipwayConfig, exists: Callable[[str], bool] = os.path.exists) -> list[Problem]:
    """All config problems that need no estimate (memory/time problems are added by the plan)."""
    lay = layout_of(cfg)
    return (
        _section_problems(cfg)
        + _divisibility(cfg, lay)
        + _warmup(cfg)
        + _precision(cfg)
        + _cluster(cfg)
        + _container(cfg)
        + _data(cfg)
        + _evaluation(cfg)
        + _names(cfg)
        + check_files(cfg, exists)
    )
