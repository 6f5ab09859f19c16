"""Site files for tests, kept outside the repository as docs/cluster.md describes (a folder on Hydra's
search path), and the site of docs/cluster.md's walkthrough: 2 nodes of 4 H100s."""

from __future__ import annotations

from pathlib import Path

from orchestrator.docs_examples import example_site

REPO = Path(__file__).resolve().parents[2]


def site_file(tmp_path: Path, name: str, text: str) -> list[str]:
    """Write ``cluster/<name>.yaml`` under ``tmp_path`` and return the overrides that select it."""
    conf = tmp_path / "site-conf"
    (conf / "cluster").mkdir(parents=True, exist_ok=True)
    (conf / "cluster" / f"{name}.yaml").write_text(text)
    return [f"cluster={name}", f"hydra.searchpath=[file://{conf}]"]


def docs_site() -> str:
    """The example site file of docs/cluster.md (step 2), as the page prints it (the docs' own reader)."""
    name, text = example_site((REPO / "docs" / "cluster.md").read_text(encoding="utf-8"))
    assert name == "mysite", name
    return text


# A site of 4-GPU H100 nodes as a user writes one, with the keys a site file always had (no peak, no
# memory: the device table's) ...
H100_X4 = """executor: slurm
partition: gpu
gpus_per_node: 4
cpus_per_task: 16
mem_gb: 0
time_limit_min: 720
device_name: H100-80GB
stage_partition: cpu
"""
# ... and with its limits: 2 nodes of 64 cores.
H100_X4_LIMITS = H100_X4 + "max_nodes: 2\ncpus_per_node: 64\n"
