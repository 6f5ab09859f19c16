"""The examples of docs/cluster.md that are the plan's own output, regenerated as docs/config.md is
(``python -m orchestrator.docs`` writes both; ``--check`` and tests/orchestrator/test_docs.py fail when
either is stale).

A generated example sits between two markers, right after the ```bash block whose last ``python launch.py``
line it is the dry run of::

    <!-- generated: layout=auto table (python -m orchestrator.docs) -->

        Auto layout (layout=auto): ...

    <!-- end generated -->

The command runs against the page's own example site file (the ```yaml block headed
``# hydra_conf/cluster/<site>.yaml``), composed as launch.py composes it, planned without the input files
(they are the user's) and with an empty environment, so the text depends on the repository alone: the
configs, the device table, the measured MFU in bench/results/, the estimate.
"""

from __future__ import annotations

import re
import shlex
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "cluster.md"
BEGIN = "<!-- generated: layout=auto table (python -m orchestrator.docs) -->"
END = "<!-- end generated -->"
_SITE = re.compile(r"```yaml\n(# hydra_conf/cluster/(\w+)\.yaml.*?)```", re.S)
_BLOCK = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)


def example_site(page: str) -> tuple[str, str]:
    """(name, text) of the page's example site file."""
    found = _SITE.search(page)
    if not found:
        raise ValueError("docs/cluster.md has no example site file (a ```yaml block headed "
                         "# hydra_conf/cluster/<site>.yaml)")
    return found.group(2), found.group(1)


def example_command(page: str, at: int) -> list[str]:
    """The overrides of the last ``python launch.py`` line of the ```bash block before offset ``at``, less
    ``dry_run=true`` (the example is a dry run's output)."""
    blocks = re.findall(r"```bash\n(.*?)```", page[:at], re.S)
    lines = [ln.split("#")[0].strip() for ln in (blocks[-1] if blocks else "").splitlines()]
    launches = [ln for ln in lines if ln.startswith("python launch.py")]
    if not launches:
        raise ValueError(f"docs/cluster.md: no ```bash block with a python launch.py line before {BEGIN}")
    return [a for a in shlex.split(launches[-1])[2:] if a != "dry_run=true"]


def _typed(overrides: list[str], site: tuple[str, str]) -> Any:
    """The typed config of ``overrides`` with the site file in a folder on Hydra's search path."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from orchestrator.base.schema import register, to_typed
    from orchestrator.base.site import apply_site

    register()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "cluster").mkdir()
        (Path(tmp) / "cluster" / f"{site[0]}.yaml").write_text(site[1], encoding="utf-8")
        over = [*overrides, f"hydra.searchpath=[file://{tmp}]"]
        with initialize_config_dir(config_dir=str(REPO / "hydra_conf"), version_base="1.3"):
            cfg = compose("config", overrides=over, return_hydra_config=True)
            choices = dict(cfg.hydra.runtime.choices)
            with open_dict(cfg):
                del cfg["hydra"]
            return to_typed(apply_site(cfg, choices, over), choices)


def layout_table(overrides: list[str], site: tuple[str, str]) -> list[str]:
    """The dry run's layout=auto table for ``overrides``, as the plan prints it."""
    from orchestrator.planning.autolayout import proposal_lines
    from orchestrator.planning.plan import PlanInputs, make_plan

    cfg = _typed(overrides, site)
    plan = make_plan(cfg, PlanInputs("r", "/runs/r", environ={}), exists=lambda p: True)
    if plan.proposal is None:
        raise ValueError(f"docs/cluster.md: {' '.join(overrides)} is no layout=auto run")
    return proposal_lines(plan.config, plan.proposal)


def render_page(page: str) -> str:
    """``page`` with every generated example written afresh (ValueError when it has none)."""
    site = example_site(page)
    blocks = list(_BLOCK.finditer(page))
    if not blocks:
        raise ValueError(f"docs/cluster.md has no generated example ({BEGIN} ... {END})")
    out, last = [], 0
    for block in blocks:
        lines = layout_table(example_command(page, block.start()), site)
        out += [page[last:block.start()], BEGIN, "\n\n", *(f"    {ln}\n" for ln in lines), "\n", END]
        last = block.end()
    return "".join(out) + page[last:]
