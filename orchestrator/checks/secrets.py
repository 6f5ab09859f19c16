"""What must never reach a real job: secrets in the config, test-only hooks, and an online W&B run without
a key.

- ``secret_in_config``: a secret-named entry of ``cluster.env``/``cluster.sbatch_extra``, a secret
  assignment in ``cluster.setup``, a value that looks like a secret anywhere in the config (see
  orchestrator/base/redaction.py, the one definition), or the value of a secret variable of the launching
  environment copied into the config (``${oc.env:DB_PASSWD}``). Secrets belong in the environment one
  launches from; the value is never shown (``<redacted>``).
- ``wandb_key``: ``logging.wandb.mode=online`` with no W&B API key in the launching environment or
  ``~/.netrc`` (the jobs get both); ``wandb_key_home``: the key only in a netrc file that a
  ``container=pyxis`` job does not mount.
- ``test_hook``: a hook variable (trainer/faults.py) in ``cluster.env`` or the launching
  environment, without the switch ``SLIPWAY_TESTING=1`` in the launching environment.

Checks of the typed config and the launching environment (``Context.environ``). :func:`known_secrets`
is no check: it gives the launch the config's secret values to hide in everything it prints, by the same
rules that refuse them here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from orchestrator.base.plan_types import Context
from orchestrator.base.problems import Problem
from orchestrator.base.redaction import HEX40, is_secret_name, secret_assignments, secret_kind
from orchestrator.base.schema import SlipwayConfig
from orchestrator.world.container import mount_points
from trainer import faults
from trainer.run_files import RUN_JSON
from trainer.wandb_key import has_wandb_key, missing_key_message, netrc_path, wandb_host

_REMOVE = "remove it from the config and export it in the environment you launch from (Slurm passes it on)"


def _strings(obj: object, key: str) -> Iterator[tuple[str, str]]:
    """(dotted key, string) for every string in a config tree."""
    if isinstance(obj, str):
        yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(v, f"{key}.{k}" if key else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _strings(v, f"{key}[{i}]")


def _secret(key: str, message: str, fix: str = _REMOVE) -> Problem:
    return Problem("secret_in_config", key, "<redacted>", message, fix)


def _cluster_secrets(cfg: SlipwayConfig) -> list[Problem]:
    c, out = cfg.cluster, []
    for section, entries in (("env", c.env), ("sbatch_extra", c.sbatch_extra)):
        for name, value in entries.items():
            key = f"cluster.{section}.{name}"
            if is_secret_name(name):
                out.append(_secret(key, f"a secret-named entry; configs, job scripts and {RUN_JSON} are "
                                        "written to disk", f"remove it and export {name} in the environment "
                                                           "you launch from (Slurm passes it on)"))
            elif kind := secret_kind(str(value), secret_position=True):
                out.append(_secret(key, f"its value looks like a secret ({kind})"))
    for i, line in enumerate(c.setup):
        names = [n for n, _ in secret_assignments(line)]
        kind = secret_kind(line, secret_position=True)
        if names or kind:
            what = f"assigns the secret {names[0]} a literal value" if names else f"contains a {kind}"
            out.append(_secret(f"cluster.setup[{i}]", what, "read it from the environment instead "
                                                            "(export NAME=\"$NAME\"), or export it before "
                                                            "launching"))
    return out


def secret_problems(ctx: Context) -> list[Problem]:
    """Every place of the config that holds a secret (see the module docstring)."""
    cfg, environ = ctx.cfg, ctx.environ
    out = _cluster_secrets(cfg)
    flagged = {p.key for p in out}
    env_values = {v: k for k, v in environ.items() if is_secret_name(k) and v and len(v) >= 8}
    for key, text in _strings(dataclasses.asdict(cfg), ""):
        if any(key == f or key.startswith(f + "[") for f in flagged):
            continue
        if kind := secret_kind(text):
            out.append(_secret(key, f"the value looks like a secret ({kind})"))
        elif name := next((n for v, n in env_values.items() if v in text), None):
            out.append(_secret(key, f"the value contains the secret {name} of the launching environment"))
    return out


def hook_problems(ctx: Context) -> list[Problem]:
    """Test-only hooks set in ``cluster.env`` or the launching environment, unless the switch is on there."""
    cfg, environ = ctx.cfg, ctx.environ
    if faults.switch_on(environ):
        return []
    fix = f"tests that need it set {faults.SWITCH}=1"
    out: list[Problem] = []
    for where, env in (("cluster.env.", cfg.cluster.env), ("environment variable ", environ)):
        for name, value in faults.active_env_hooks(env).items():
            undo = f"unset {name} in the shell you launch from" if where.startswith("env") else "remove it"
            out.append(Problem("test_hook", where + name, value,
                               f"a test-only hook: {faults.ENV_HOOKS[name]}", f"{undo}; {fix}"))
    return out


def wandb_key_problems(ctx: Context) -> list[Problem]:
    """W&B online needs a key where the jobs will look for it (trainer/wandb_key.py): without one every
    attempt of the training job would fail at start. A key only in the netrc file reaches a pyxis job only
    when the file lies in a folder the job mounts (pyxis runs with --no-container-mount-home)."""
    environ = ctx.environ
    if ctx.cfg.logging.wandb.mode != "online" or environ.get("WANDB_API_KEY"):
        return []
    if not has_wandb_key(environ):
        return [Problem("wandb_key", "logging.wandb.mode", "online", missing_key_message(environ),
                        "export WANDB_API_KEY in the shell you launch from (Slurm passes it on) or run "
                        "`wandb login` (~/.netrc); or set logging.wandb.mode=offline (upload later with "
                        "wandb sync) or disabled")]
    netrc = netrc_path(environ)
    if ctx.cfg.container.kind != "pyxis" or any(_under(netrc, d) for _, d in mount_points(ctx.cfg)):
        return []
    read = f"python -c \"import netrc; print(netrc.netrc().authenticators('{wandb_host(environ)}')[2])\""
    return [Problem("wandb_key_home", "logging.wandb.mode", "online",
                    f"the W&B key is only in {netrc}, which a container=pyxis job does not see (pyxis "
                    "mounts no home directory, only the run's folders and container.binds)",
                    "export WANDB_API_KEY in the shell you launch from (WANDB_* reaches the container), "
                    f"e.g. export WANDB_API_KEY=$({read}); or keep the netrc in a folder the job mounts "
                    "(container.binds) and export NETRC=<that file>; or set logging.wandb.mode=offline")]


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def known_secrets(cfg: SlipwayConfig) -> dict[str, str]:
    """{value: where} of the secret values the config holds, so that everything printed can hide them."""
    c, out = cfg.cluster, {}
    for section, entries in (("env", c.env), ("sbatch_extra", c.sbatch_extra)):
        for name, value in entries.items():
            if is_secret_name(name) or secret_kind(str(value), secret_position=True):
                out[str(value)] = f"cluster.{section}.{name}"
    for i, line in enumerate(c.setup):
        out.update({value: name for name, value in secret_assignments(line)})
        out.update({m: f"cluster.setup[{i}]" for m in HEX40.findall(line)})
    return out
