"""The checkpoints the training job would resume from, read before anything is submitted: they verify
(cheaply: sizes against each manifest), they are the configured model, and no other job of the run (or
other writer of its checkpoint directory) is active — the dry run's view of what the launch's writer lock
(orchestrator/record/writer_lock.py) refuses."""

from __future__ import annotations

import os

from orchestrator.base.plan_types import Context, Plan
from orchestrator.base.problems import Problem
from orchestrator.record import launches
from orchestrator.record.writer_lock import active_jobs, run_active
from orchestrator.stages.train import NAME as TRAIN
from orchestrator.world.runs import hf_vocab_entries, vocab_entries
from trainer.checkpoint import verify as ckpt_verify
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE
from trainer.data.tokenizer_identity import DIGEST_ARG, identify, resume_refusal
from trainer.formulas import model_vocab_size


def checkpoint_problems(ctx: Context) -> list[Problem]:
    """What the training job would find in the checkpoint directory it resumes from, checked cheaply now
    (sizes against each manifest; the job also verifies checksums): a damaged latest checkpoint or a
    missing/garbage tracker becomes a warning (the job loads the newest good one); checkpoints of which
    none verifies are a problem (the job would refuse to start rather than overwrite them)."""
    plan = ctx.require_plan()
    ck = plan.stage(TRAIN).job.trainer_config["checkpoint"]
    if ck.get("load") not in (None, "latest") or not os.path.isdir(ck["dir"]):
        return []
    try:
        choice = ckpt_verify.choose_latest(ck["dir"], full=False, act=False)
    except ckpt_verify.NoVerifiedCheckpoint as err:
        return [Problem("checkpoint_damaged", "checkpoint.dir", ck["dir"], str(err),
                        "restore a good copy of a checkpoint, or start a new run (no run_id, or another "
                        "checkpoint.dir); damaged folders are never deleted")]
    plan.warnings.extend(f"{w} (the training job will load iteration {choice.iteration} instead)"
                         if "failed verification" in w else w for w in choice.warnings)
    if choice.iteration is None:
        return []
    past = _past_iters(ck["dir"], choice.iteration, ctx.cfg.train.iters)
    return past + _model_problems(plan, ck["dir"], choice.iteration)


def _past_iters(ckpt_dir: str, iteration: int, iters: int) -> list[Problem]:
    """A checkpoint past ``train.iters``: the job would load it and stop at once, looking complete while
    training nothing (and a conversion would hold the later iteration, not the one asked for)."""
    if iteration <= iters:
        return []
    return [Problem(
        "iters_below_checkpoint", "train.iters", iters,
        f"the run's checkpoints ({ckpt_dir}) are at iteration {iteration}, past train.iters={iters}: the "
        f"training job would load iteration {iteration} and train nothing",
        f"to train further set train.iters above {iteration} (e.g. train.iters={iteration + iters}); to "
        f"train to {iters} start a new run (another run_id), from these weights with checkpoint.load="
        f"model-only checkpoint.load_dir={ckpt_dir} if you want them")]


def _model_problems(plan: Plan, ckpt_dir: str, iteration: int) -> list[Problem]:
    """The checkpoint the training job would resume from must be the configured model: the trainer's
    own comparison (trainer.checkpoint.files.config_differences: shape and architecture), made here so
    that a relaunch with a changed model section is refused before anything is submitted or recorded."""
    from trainer.checkpoint.files import CheckpointError, config_differences
    from trainer.checkpoint.protocol import saved_layout
    from trainer.config import ModelConfig
    from trainer.config_issues import ConfigError

    try:
        args = saved_layout(ckpt_dir, iteration, mmap=True)[2]
    except CheckpointError:
        return []  # not a Slipway checkpoint (torch_dist, foreign): the trainer says what to do with it
    tc = plan.stage(TRAIN).job.trainer_config
    out = _tokenizer_problems(tc, args, ckpt_dir, iteration)
    model = dict(tc["model"])
    tok = tc["tokenizer"]  # the tokenizer is read only when its size matters (loading one takes seconds)
    entries = None if model.get("vocab_size") else (
        hf_vocab_entries(tok.get("model")) if tok.get("type") == HF_TOKENIZER_TYPE
        else vocab_entries(tok.get("vocab_file")))
    model["vocab_size"] = model_vocab_size(model.get("vocab_size"), entries)  # as the trainer builds it
    try:
        wrong = config_differences(args, ModelConfig(**model))
    except (ConfigError, TypeError, ValueError):
        return out  # a broken model section: the config checks report it
    if not wrong:
        return out
    diffs = ", ".join(f"{k} {saved} → {now}" for k, (saved, now) in wrong.items())
    old = " ".join(f"model.{k}={saved}" for k, (saved, _) in wrong.items())
    return out + [Problem(
        "checkpoint_model", "model", diffs,
        f"the run's checkpoints ({ckpt_dir}, iteration {iteration}) are a different model (saved → "
        f"configured): {diffs}; the training job would refuse to load them",
        f"start a new run (another run_id; to start from these weights use checkpoint.load=model-only "
        f"checkpoint.load_dir={ckpt_dir}), or keep the old values: {old}")]


def _tokenizer_problems(tc: dict, args: object, ckpt_dir: str, iteration: int) -> list[Problem]:
    """The checkpoint the job would resume from must have been trained with the run's tokenizer, by the
    digest its args record (the trainer refuses it too, before loading); an unrecorded one (Megatron-LM's,
    an older Slipway's) loads with a note."""
    from trainer.checkpoint.files import arg

    saved = arg(args, DIGEST_ARG)
    current = identify(tc["tokenizer"])
    refusal = resume_refusal(saved, current, ckpt_dir, iteration) if saved else None
    return [Problem("checkpoint_tokenizer", "tokenizer", current.files, *refusal)] if refusal else []


def record_problems(ctx: Context) -> list[Problem]:
    """The run's ``run.json`` must be readable when the run has one: a relaunch reads its job ids to refuse
    a second writer, and a damaged record must stop it, not pass for an empty history."""
    plan = ctx.require_plan()
    try:
        launches.read(plan.run_dir)
    except launches.RunRecordError as err:
        what, _, fix = str(err).partition(". ")
        return [Problem("run_record", "run_id", plan.run_id, what, fix)]
    return []


def active_problems(ctx: Context) -> list[Problem]:
    """The dry run's ``run_active``: what writer_lock.single_writer would refuse (reads only), the jobs a
    dead launch submitted without recording them included. A real launch asks under its lock instead."""
    if not ctx.cfg.dry_run:
        return []
    plan = ctx.require_plan()
    active: list[str] = []
    try:
        record = launches.LaunchRecord.load(plan.run_dir)
        active += active_jobs(plan, record.data)
        active += [f"{stage} job {jid} ({state}) submitted by launch {n}, which died before recording it"
                   for n, stage, jid, state in record.orphans() if jid]
    except launches.RunRecordError:
        return []  # record_problems reports it
    except RuntimeError as err:
        active.append(str(err))
    return [run_active(plan, active)] if active else []
