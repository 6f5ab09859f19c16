"""One definition of a secret (orchestrator/base/redaction.py): no secret value reaches a file of the run, the
cache or a sweep directory, nor anything a launch prints — dry run, refused launch, failed local run.

Secrets are given under several spellings in ``cluster.env``, ``cluster.sbatch_extra`` and
``cluster.setup`` (refused: ``secret_in_config``) and in the launching environment (allowed: forwarded by
reference). Every file written under the test's folder and all printed output are searched for the values.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.base import redaction
from orchestrator.base.plan_types import Context
from orchestrator.checks.secrets import known_secrets, secret_problems
from orchestrator.launch.flow import EXIT_ERROR, EXIT_PROBLEMS, EXIT_RUN_FAILED
from tests.orchestrator.conftest import REPO, compose_cfg, user_docs
from tests.seam import hook_env

HF = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
GHP = "ghp_abcdefghijklmnopqrstuvwxyz0123456789AB"
AKIA = "AKIAABCDEFGHIJKLMNOP"
WANDB = "0123456789abcdef0123456789abcdef01234567"
PEM = "-----BEGIN OPENSSH PRIVATE KEY-----b3BlbnNzaC1rZXktdjEAAAAA-----END OPENSSH PRIVATE KEY-----"

# override → the secret value it carries (names: several spellings and markers; values: the patterns)
CONFIG_SECRETS = {
    "+cluster.env.DB_PASSWD=pw-cfg-passwd-1": "pw-cfg-passwd-1",
    "+cluster.env.db_password=pw-cfg-password-2": "pw-cfg-password-2",
    "+cluster.env.My_Api_Key=pw-cfg-apikey-3": "pw-cfg-apikey-3",
    "+cluster.env.AWS_SECRET_ACCESS_KEY=pw-cfg-aws-4": "pw-cfg-aws-4",
    "+cluster.env.GCP_CREDENTIALS=pw-cfg-cred-5": "pw-cfg-cred-5",
    f"+cluster.env.SOME_URL={GHP}": GHP,  # a harmless name, a secret value
    f"+cluster.sbatch_extra.comment={AKIA}": AKIA,
    "+cluster.sbatch_extra.auth_token=pw-cfg-token-6": "pw-cfg-token-6",
}
SETUP = ["export GITHUB_TOKEN=pw-cfg-setup-7", f"export WANDB_API_KEY={WANDB}", f"echo {HF}", "module load x"]
SETUP_SECRETS = ["pw-cfg-setup-7", WANDB, HF]
# The launching environment: legitimate, but never written or printed either.
ENV_SECRETS = {"WANDB_API_KEY": "env-wandb-0a1b2c3d", "DB_PASSWORD": "env-dbpass-4e5f6a", "SSH_KEY": PEM}
ALL = [*CONFIG_SECRETS.values(), *SETUP_SECRETS, *ENV_SECRETS.values(), "b3BlbnNzaC1rZXktdjEAAAAA"]


def _overrides(runs_root: Path) -> list[str]:
    setup = "[" + ",".join(f"'{line}'" for line in SETUP) + "]"
    return [*CONFIG_SECRETS, f"cluster.setup={setup}", f"runs_root={runs_root}"]


def _leaks(root: Path, *texts: str) -> list[str]:
    """Where any secret value appears: '<file>: <value>' for files under root, 'output: <value>'."""
    found = [f"output: {v}" for t in texts for v in ALL if v in t]
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path}: {v}" for v in ALL if v.encode() in data]
    return found


def _launch(args: list[str], cwd: Path = REPO, timeout: int = 240, hooks: dict | None = None
            ) -> subprocess.CompletedProcess:
    env = dict(os.environ, **ENV_SECRETS, **(hooks or {}))
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", ["DB_PASSWD", "db_password", "My_Api_Key", "HF_TOKEN", "GCP_CREDENTIALS",
                                  "client-secret", "cluster.env.AWS_SECRET_ACCESS_KEY"])
def test_secret_names(name):
    assert redaction.is_secret_name(name)


@pytest.mark.parametrize("name", ["max_new_tokens", "tokenizer", "data.json_key", "sort_keys", "num_tokens",
                                  "TOKENIZERS_PARALLELISM", "json-keys"])
def test_ordinary_names_are_not_secrets(name):
    """Whole words only: the summary's `max_new_tokens=32` or `data.json_key=content` stay readable."""
    assert not redaction.is_secret_name(name)
    assert redaction.Redactor()(f"{name}=32") == f"{name}=32"


@pytest.mark.parametrize("value,kind", [(HF, "hf_token"), (GHP, "github_token"), (AKIA, "aws_access_key"),
                                        (PEM, "private_key")])
def test_secret_values_anywhere(value, kind):
    assert redaction.secret_kind(f"x {value} y") == kind
    assert value not in redaction.Redactor()(f"a={value} b")


def test_hex_keys_only_where_a_secret_sits():
    """A 40-hex string is a git sha or a Hugging Face snapshot folder in a path, a W&B key in cluster.env."""
    snapshot = f"/hub/models--gpt2/snapshots/{WANDB}/vocab.json"
    assert redaction.secret_kind(snapshot) is None and redaction.Redactor()(snapshot) == snapshot
    assert redaction.secret_kind(WANDB, secret_position=True) == "hex40_key"


def test_assignments_hide_literals_and_keep_references():
    r = redaction.Redactor()
    assert r("export DB_PASSWD=hunter22 && x") == "export DB_PASSWD=<redacted> && x"
    assert r("['+cluster.env.Db_Passwd=hunter22', 'a=b']") == "['+cluster.env.Db_Passwd=<redacted>', 'a=b']"
    assert r('--api-key="hunter22"') == '--api-key="<redacted>"'
    assert r('export HF_TOKEN="${HF_TOKEN}"') == 'export HF_TOKEN="${HF_TOKEN}"'


def test_validation_finds_every_config_secret():
    cfg = compose_cfg(["+experiment=codeparrot_smoke", *_overrides(Path("/tmp/never"))])
    keys = {p.key for p in secret_problems(Context(cfg, {}))}
    expect = {o.partition("=")[0].lstrip("+") for o in CONFIG_SECRETS}
    assert keys == expect | {"cluster.setup[0]", "cluster.setup[1]", "cluster.setup[2]"}
    assert set(known_secrets(cfg)) >= set(CONFIG_SECRETS.values()) | set(SETUP_SECRETS[:2])
    # A launching environment's secret copied into the config (${oc.env:...}) is a secret in the config.
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "checkpoint.load_dir=/ckpt/env-dbpass-4e5f6a"])
    assert [p.key for p in secret_problems(Context(cfg, ENV_SECRETS))] == ["checkpoint.load_dir"]


@pytest.mark.timeout(300)
def test_dry_run_and_refused_launch_show_and_write_no_secret(tmp_path: Path):
    runs = tmp_path / "runs"
    # Hydra's verbose mode prints the composed config, and its default job logging writes launch.log here.
    hydra_verbose = ["hydra/job_logging=default", "hydra/hydra_logging=default", "hydra.verbose=true"]
    dry = _launch(["+experiment=codeparrot_smoke", "cluster=devcluster", "dry_run=true", *_overrides(runs),
                   *hydra_verbose], cwd=tmp_path)
    assert dry.returncode == EXIT_PROBLEMS, dry.stderr[-3000:]
    assert dry.stdout.count("[secret_in_config]") == len(CONFIG_SECRETS) + 3, dry.stdout
    assert "----- train job script -----" in dry.stdout and 'export DB_PASSWD="${DB_PASSWD}"' in dry.stdout
    assert "DB_PASSWD: <redacted:" in dry.stdout and (tmp_path / "launch.log").is_file()  # Hydra's own
    real = _launch(["+experiment=codeparrot_smoke", *_overrides(runs)], cwd=tmp_path)
    assert real.returncode == EXIT_PROBLEMS and "nothing was submitted" in real.stderr, real.stderr[-3000:]
    assert real.stderr.count("[secret_in_config]") == len(CONFIG_SECRETS) + 3
    assert _leaks(tmp_path, dry.stdout, dry.stderr, real.stdout, real.stderr) == []
    # A sweep's dry run prints every point's plan and the sweep summary, and writes nothing (multirun.yaml,
    # every override in it, is written, redacted, only when the sweep is submitted: launch/sweep.py).
    sweep = _launch(["-m", "+experiment=codeparrot_smoke", "optim.lr=1e-3,2e-3", "dry_run=true",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", *_overrides(runs)], cwd=tmp_path)
    assert sweep.returncode == EXIT_PROBLEMS and not (tmp_path / "sweep").exists()
    assert _leaks(tmp_path, sweep.stdout, sweep.stderr) == []


@pytest.mark.timeout(400)
def test_failed_local_run_ends_with_slipways_message_and_no_secret(tmp_path: Path):
    """A run that fails (SLIPWAY_FAIL_TRAIN=start) ends with the failed stage, its log and the status command,
    and exit code 3 — not Hydra's "Error executing job with overrides: [...]", which would echo every
    override, such as the secret handed to the job through Hydra's env_set, nor a traceback of launch.py."""
    args = ["+experiment=codeparrot_smoke", "data.corpus.max_files=12", "data.corpus.max_bytes=200000",
            "tokenizer.vocab_size=300", "data.workers=1",
            f"runs_root={tmp_path / 'runs'}", f"+hydra.job.env_set.HF_TOKEN={HF}", "hydra.verbose=true"]
    out = _launch(args, cwd=tmp_path, timeout=380, hooks=hook_env(FAIL_TRAIN="start"))
    assert out.returncode == EXIT_RUN_FAILED, out.stderr[-3000:]
    assert "Error executing job" not in out.stderr
    last = out.stderr.strip().splitlines()[-2:]
    assert last[0].startswith("slipway: run ")
    log = last[0].split("its log: ")[1].split(";")[0]
    # Another stage failing first is not the subject here: show its log, not just that it was another.
    assert "did not complete: stage train FAILED, its log: " in last[0], \
        (last[0], Path(log).read_text(errors="replace")[-4000:] if Path(log).is_file() else "no log")
    assert last[1].strip().startswith("status: python -m orchestrator status ")
    assert Path(log).is_file() and "training failed on purpose" in Path(log).read_text()
    assert "TEST HOOK ACTIVE: SLIPWAY_FAIL_TRAIN=start" in out.stderr  # the stage names the active hook
    assert _leaks(tmp_path, out.stdout, out.stderr) == []


def test_readme_documents_launch_exit_codes():
    text = user_docs()
    table = text.split("`launch.py` ends with one of these exit codes")[1].split("\n\n")[1]
    codes = {int(line.split("|")[1]) for line in table.splitlines()[2:]}
    assert {0, EXIT_ERROR, EXIT_PROBLEMS, EXIT_RUN_FAILED} <= codes
