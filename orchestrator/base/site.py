"""The site's hardware wins: where each cluster value of a composed config came from, and the site file's
hardware restored where an experiment changed it (Hydra-aware; launch.py calls :func:`apply_site`).

Hydra merges the experiment (``+experiment=...``, a ``_global_`` package composed after the cluster group)
over the site file, so ``gpus_per_node: 8`` in an experiment silently replaced a site's 4. Here the cluster
group file is composed alone (same search path) and compared with the full composition:

- a key the command line sets (``cluster.KEY=...``, parsed with Hydra's own override parser) comes from the
  command line; a hardware value the site file states differently is then refused by the plan
  (orchestrator/checks/cluster.py), against ``cluster.site_hardware``;
- a key the site file sets and the composition holds unchanged comes from the site file;
- anything else was set by the experiment (or is the schema default): for a layout key (an experiment's
  ``cluster.gpus``) that is its right; for a hardware key (orchestrator/base/hardware.py HARDWARE) the site
  file's value (or the default) is put back and the source says whose value was not used.

``cluster.gpus`` then becomes nodes (gpus / gpus_per_node) unless ``cluster.nodes`` came from a later
source (the command line over an experiment), which replaces it. The result is recorded in
``cluster.hardware_sources`` and ``cluster.site_hardware`` (the plan prints them).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from orchestrator.base.hardware import HARDWARE, LAYOUT
from orchestrator.base.schema import ClusterConfig

PROBE = "site_alone"  # hydra_conf/site_alone.yaml: the cluster group and nothing else
_RANK = {"default": 0, "site": 1, "experiment": 2, "command line": 3}
_MISSING = object()


def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(ClusterConfig)
            if f.default is not dataclasses.MISSING}


def command_line_keys(overrides: Sequence[str]) -> set[str]:
    """The cluster keys (``nodes``, ``sbatch_extra.exclude``, ...) the overrides set, in any spelling
    Hydra accepts (``cluster.nodes=2``, ``+cluster.x=1``, ``++cluster.nodes=2``)."""
    parsed = OverridesParser.create().parse_overrides(overrides=[o for o in overrides
                                                                 if not o.startswith("hydra.")])
    return {o.key_or_group.split(".", 1)[1] for o in parsed
            if o.key_or_group.startswith("cluster.") and not o.is_delete()}


def site_values(site: str | None, overrides: Sequence[str]) -> dict[str, Any] | None:
    """What the cluster group file ``site`` sets, composed alone with the launch's search path (a site
    file may extend another through its own defaults list); None when it cannot be composed alone."""
    if not site:
        return None
    searchpath = [o for o in overrides if o.lstrip("+").startswith("hydra.searchpath")]
    try:  # a primary config in the main search path: Hydra extends the search path only after finding it
        raw = compose(config_name=PROBE, overrides=[f"cluster={site}", *searchpath])
    except Exception:  # noqa: BLE001 - e.g. another config directory without the probe: no site view
        return None
    node = raw.get("cluster", {})
    try:
        return dict(OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - an interpolation into the rest of the config: compare unresolved
        return dict(OmegaConf.to_container(node, resolve=False))  # type: ignore[arg-type]


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


@dataclasses.dataclass
class _Sources:
    site_label: str
    experiment: str | None
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    ranks: dict[str, int] = dataclasses.field(default_factory=dict)

    def set(self, key: str, kind: str, label: str) -> None:
        self.labels[key], self.ranks[key] = label, _RANK[kind]

    @property
    def by_experiment(self) -> str:
        return f"experiment {self.experiment}" if self.experiment else "the config"


def _classify(cluster: DictConfig, key: str, site: Mapping[str, Any], cmd: set[str], src: _Sources,
              default: Any) -> None:
    """Record where ``cluster.<key>`` came from; put the site's hardware back over an experiment's."""
    value, stated = _plain(cluster.get(key)), site.get(key, _MISSING)
    if key in cmd:
        src.set(key, "command line", "command line")
    elif stated is not _MISSING and value == stated:
        src.set(key, "site", f"site file {src.site_label}")
    elif stated is _MISSING and value == default:
        src.set(key, "default", "default")
    elif key in HARDWARE:  # an experiment's hardware value: the site's (or the default) stands
        restored = default if stated is _MISSING else stated
        where = "default" if stated is _MISSING else f"site file {src.site_label}"
        cluster[key] = restored
        src.set(key, "site", f"{where} ({src.by_experiment}'s {value} not used: hardware is the site's)")
    else:
        src.set(key, "experiment", src.by_experiment)


def _nodes_from_gpus(cluster: DictConfig, src: _Sources) -> None:
    """``cluster.gpus`` decides the node count unless ``cluster.nodes`` came from a later source."""
    gpus, per_node = cluster.get("gpus"), cluster.get("gpus_per_node") or 0
    if gpus is None:
        return
    if src.ranks["nodes"] > src.ranks["gpus"]:
        cluster.gpus = None
        src.labels["gpus"] += f" (replaced by cluster.nodes from the {src.labels['nodes']})"
    elif per_node and gpus % per_node == 0 and src.ranks["nodes"] < src.ranks["gpus"]:
        cluster.nodes = gpus // per_node
        src.labels["nodes"] = f"cluster.gpus={gpus} ({src.labels['gpus']}) / {per_node} GPUs per node"
    # otherwise (no GPUs, not whole nodes, or both from one source and different): the plan refuses it


def apply_site(cfg: DictConfig, choices: Mapping[str, Any], overrides: Sequence[str]) -> DictConfig:
    """``cfg`` (composed) with the site's hardware restored and ``cluster.hardware_sources`` /
    ``cluster.site_hardware`` filled. ``choices``: Hydra's group choices; ``overrides``: the launch's
    command-line overrides (task and hydra ones)."""
    site_name, experiment = choices.get("cluster"), choices.get("experiment")
    site = site_values(site_name, overrides)
    cfg = copy.deepcopy(cfg)
    cmd, defaults = command_line_keys(overrides), _defaults()
    src = _Sources(f"cluster/{site_name}.yaml", str(experiment) if experiment else None)
    with open_dict(cfg):
        cluster = cfg.cluster
        for key in (*HARDWARE, *LAYOUT):
            if site is not None:
                _classify(cluster, key, site, cmd, src, defaults.get(key))
            elif key in cmd:  # no view of the site file alone: the composition as it is, said so
                src.set(key, "command line", "command line")
            else:  # an experiment's cluster.gpus still sizes the job over the nodes the config has
                src.set(key, "experiment" if key == "gpus" else "site",
                        "config (the site file could not be composed alone)")
        _nodes_from_gpus(cluster, src)
        cluster.hardware_sources = {**src.labels, "site": src.site_label}
        cluster.site_hardware = {k: site[k] for k in HARDWARE if k in (site or {})}
    return cfg
