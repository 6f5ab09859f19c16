"""Slipway's entry point: compose the Hydra config, type it, hand it to the orchestrator.

    python launch.py +experiment=codeparrot_smoke                 # the whole pipeline on this machine
    python launch.py +experiment=codeparrot_smoke cluster=devcluster
    python launch.py +experiment=codeparrot dry_run=true          # plan + job scripts, submits nothing
    python launch.py -m +experiment=codeparrot optim.lr=1e-4,3e-4,5e-4   # a sweep; returns at once

A multirun is all or nothing: Slipway's sweeper (hydra_plugins/slipway_sweeper) calls ``main`` for every
point to plan and check it, prints one sweep summary, and only then calls it again for every point to
submit it (orchestrator/launch/sweep.py); points needing the same preprocessing share one job (content keys).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from orchestrator.base import redaction
from orchestrator.base.facts import SweepInfo
from orchestrator.base.overrides import quote_image_refs
from orchestrator.base.problems import PlanError
from orchestrator.base.schema import SlipwayConfig, register, to_typed
from orchestrator.base.site import apply_site
from orchestrator.launch import hydra_errors
from orchestrator.launch import sweep as sweeps
from orchestrator.launch.flow import EXIT_ERROR, EXIT_PROBLEMS, EXIT_RUN_FAILED, RunFailed, launch
from orchestrator.launch.submit import SubmitError
from orchestrator.record.launches import RunRecordError

register()


def _sweep_info() -> SweepInfo | None:
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    sweep_dir = os.path.abspath(hc.sweep.dir)
    overrides = tuple(x for x in hc.job.override_dirname.split(",") if x)
    return SweepInfo(os.path.basename(sweep_dir), sweep_dir, int(hc.job.num), overrides)


@hydra.main(config_path="hydra_conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # Every outcome ends here with Slipway's message and exit code: an exception escaping this function
    # would make Hydra print "Error executing job with overrides: [...]", every override (secrets too).
    try:
        hc = HydraConfig.get()
        choices, task, sweep = dict(hc.runtime.choices), tuple(hc.overrides.task), _sweep_info()
        if sweep is None:
            hydra_errors.composed()  # a single run's config is composed (a sweep's: its sweeper says)

        def typed_config() -> SlipwayConfig:
            # The site file's hardware wins over an experiment's (orchestrator/base/site.py); keys the schema
            # does not have are refused, +key=value included (to_typed).
            return to_typed(apply_site(cfg, choices, (*hc.overrides.hydra, *task)), choices)

        collector = sweeps.active()
        if sweep is not None and collector is not None:  # Slipway's sweeper: plan (or submit) this point
            collector.point(sweep, typed_config, task)
            return
        typed = typed_config()
        result = launch(typed, sweep, overrides=task)
    except PlanError as err:
        sys.stderr.write(f"{err}\n")
        sys.exit(EXIT_PROBLEMS)
    except RunFailed as err:
        sys.stderr.write(f"slipway: {err}\n")
        sys.exit(EXIT_RUN_FAILED)
    except KeyboardInterrupt as err:
        sys.exit(128 + getattr(err, "signum", signal.SIGINT))  # the shell's convention: 130, 143, 129
    except (RunRecordError, SubmitError) as err:  # conditions a user causes and fixes: one line, no traceback
        sys.stderr.write(f"slipway: {err}\n")
        sys.exit(EXIT_PROBLEMS)
    except OSError as err:  # a disk that filled up, a folder that went read-only after the checks
        where = f" ({err.filename})" if err.filename else ""
        sys.stderr.write(f"slipway: {err.strerror or err}{where}; nothing more was submitted: free the space "
                         "or fix the permissions, then launch the same run_id again\n")
        sys.exit(EXIT_ERROR)
    except Exception:
        sys.stderr.write(f"slipway: launch failed unexpectedly:\n{traceback.format_exc()}")
        sys.exit(EXIT_ERROR)
    if typed.dry_run and result.plan.problems:
        sys.exit(EXIT_PROBLEMS)  # the printed plan lists what would stop a real launch


if __name__ == "__main__":
    # container.image=nvcr.io#nvidia/pytorch:24.07-py3 as pyxis writes it (Hydra's grammar needs it quoted).
    sys.argv[1:] = quote_image_refs(sys.argv[1:])
    # Secrets from the environment and the command line are hidden from everything printed, Hydra's own
    # errors included (orchestrator/base/redaction.py).
    redaction.REDACTOR.add(redaction.environ_secrets(os.environ) | redaction.argv_secrets(sys.argv[1:]))
    redaction.install()
    # Hydra's own errors (an unknown key, a value of the wrong type) come back here to be said as Slipway's
    # problems with a fix (orchestrator/launch/hydra_errors.py); main() reports everything else itself.
    with hydra_errors.raised() as ours:
        try:
            main()
        except Exception as hydra_error:
            if not ours:
                raise  # HYDRA_FULL_ERROR=1 was the user's: Hydra's full traceback
            text, code = hydra_errors.report(hydra_error)
            sys.stderr.write(text)
            sys.exit(code)
