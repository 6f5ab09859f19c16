"""docs/config.md is generated from the schema and must be current (CI runs this with every test run)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import docs, docs_examples
from orchestrator.base import schema
from tests.orchestrator.conftest import REPO, user_docs


def cells(line: str) -> list[str]:
    """The cells of a Markdown table row (escaped pipes stay inside their cell)."""
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


@pytest.fixture(scope="module")
def generated() -> str:
    return docs.render()


def test_config_md_is_current(generated):
    problem = docs.check(docs.OUTPUT, generated)
    assert problem is None, problem


def test_every_schema_key_is_documented_with_its_default(generated):
    """Every leaf field of every section appears as a row with its schema default and a meaning."""
    rows = {cells(ln)[0].strip("`"): ln for ln in generated.splitlines() if ln.startswith("| `")}
    expected = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            sub = docs._nested(cls, f.name)
            key = f"{prefix}{f.name}"
            walk(sub, f"{key}.") if sub else expected.append((key, docs._default(f)))

    walk(schema.SlipwayConfig, "")
    assert sorted(rows) == sorted(k for k, _ in expected)
    for key, default in expected:
        row = cells(rows[key])
        assert row[2] == docs.fmt(default).replace("|", "\\|"), key
        assert len(row[-1]) > 5 and row[-1].endswith("."), f"{key}: meaning {row[-1]!r}"
    assert "| `checkpoint.load_dir` | `str \\| None` | `null` |" in generated


def test_experiment_columns_are_the_composed_values(generated, compose_config):
    """The codeparrot column holds what launch.py composes (unresolved interpolations kept as written)."""
    head = cells(next(ln for ln in generated.splitlines() if ln.startswith("| key |")))
    col = head.index("codeparrot")

    def row(key: str) -> list[str]:
        return cells(next(ln for ln in generated.splitlines() if ln.startswith(f"| `{key}` |")))

    composed = compose_config(["+experiment=codeparrot"])
    assert row("train.global_batch_size")[col] == f"`{composed.train.global_batch_size}`"
    assert row("cluster.partition")[col] == "`${oc.env:SLIPWAY_PARTITION,gpu}`"
    assert row("data.corpus.max_files")[col] == "—"  # data.corpus is null in codeparrot


def test_undocumented_field_is_named_with_the_fix():
    source = '''
from dataclasses import dataclass

@dataclass
class Tiny:
    """A section."""

    good: int = 1
    """Documented."""
    bad: int = 2  # a comment is not documentation
'''
    docs_of = docs.attribute_docs(source)
    assert docs_of["Tiny"].fields["good"].doc == "Documented."
    assert docs_of["Tiny"].fields["bad"].doc is None
    ns: dict = {}
    exec(compile(source, "<tiny>", "exec"), ns)
    assert docs.missing_docs(ns["Tiny"], docs_of) == ["Tiny.bad"]


def test_check_names_the_fix_command(tmp_path, generated):
    stale = tmp_path / "config.md"
    assert "does not exist" in docs.check(stale, generated) and docs.FIX in docs.check(stale, generated)
    stale.write_text(generated.replace("Peak learning rate", "Top learning rate"))
    problem = docs.check(stale, generated)
    assert problem is not None and "python -m orchestrator.docs" in problem
    assert "-| `optim.lr`" in problem and "+| `optim.lr`" in problem


def test_cli_check_exits_1_on_a_stale_file(tmp_path):
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    out = subprocess.run([sys.executable, "-m", "orchestrator.docs", "--check", "--output", str(stale)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "regenerate it with: python -m orchestrator.docs" in out.stderr


@pytest.fixture(scope="module")
def cluster_page() -> str:
    return docs_examples.PAGE.read_text(encoding="utf-8")


def test_cluster_md_layout_table_is_what_the_plan_prints(cluster_page):
    """docs/cluster.md's layout=auto table is the dry run of the command above it on the page's own site
    file (issue 52 item 5: it had drifted from what the plan printed)."""
    problem = docs.check(docs_examples.PAGE, docs_examples.render_page(cluster_page))
    assert problem is None, problem
    overrides = docs_examples.example_command(cluster_page, cluster_page.index(docs_examples.BEGIN))
    assert overrides == ["+experiment=codeparrot", "cluster=mysite", "layout=auto", "tune=true"]
    table = cluster_page.split(docs_examples.BEGIN)[1].split(docs_examples.END)[0]
    assert "Auto layout (layout=auto): world 8 = 2 node(s) × 4 task(s)" in table and "← first choice" in table


def test_a_stale_layout_table_is_found_and_regenerated(tmp_path, cluster_page):
    """A table edited by hand (or left behind by a change to the estimate) fails the check, which names the
    fix; regenerating gives the current page back. A page without the markers is an error, not a pass."""
    table = cluster_page.split(docs_examples.BEGIN)[1].split(docs_examples.END)[0]
    first = next(ln for ln in table.splitlines() if "← first choice" in ln)
    stale = cluster_page.replace(first, first.replace("tp1", "tp4"))
    page = tmp_path / "cluster.md"
    page.write_text(stale)
    problem = docs.check(page, docs_examples.render_page(stale))
    assert problem is not None and docs.FIX in problem and f"+{first}" in problem
    assert docs_examples.render_page(stale) == cluster_page
    with pytest.raises(ValueError, match="no generated example"):
        docs_examples.render_page(cluster_page.replace(docs_examples.BEGIN, "<!-- -->"))


def _default(f: dataclasses.Field) -> object:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _resolves(key: str) -> bool:
    """Whether a dotted key names a schema field (entries below a dict field, e.g. cluster.env.X, count)."""
    node: object = schema.SlipwayConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return True  # inside a dict-valued field
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return False
        default = _default(fields[part])
        node = type(default) if dataclasses.is_dataclass(default) else default
    return True


def test_every_key_the_readme_names_exists():
    """Advice in README.md or docs/ that names a key the schema lacks (a removed or planning-only option)
    fails here."""
    root = dataclasses.fields(schema.SlipwayConfig)
    sections = {f.name for f in root if dataclasses.is_dataclass(_default(f))}
    text = user_docs()
    # A key followed by "(" is Python in a code sample (model.generate(...)), not a configuration key.
    keys = set(re.findall(rf"(?<![\w./+-])\+?((?:{'|'.join(sections)})\.[a-z_]+(?:\.[A-Za-z_]+)*)(?![\w(])",
                          text))
    assert len(keys) > 20, keys  # the pattern still finds the README's keys
    # The typos the docs show, and file names.
    not_keys = {"optim.lrr", "cluster.time", "model.safetensors", "tokenizer.json"}
    assert sorted(k for k in keys - not_keys if not _resolves(k)) == []


def test_every_problem_code_the_readme_names_exists():
    """The troubleshooting row lists problem codes; each must still be a code the orchestrator reports."""
    row = next(line for line in (REPO / "docs" / "troubleshooting.md").read_text().splitlines()
               if line.startswith("| `N configuration problem(s)"))
    advice = row.split(" | ")[1]
    single_words = ("memory", "warmup", "name", "world", "batch", "precision")
    codes = {c for c in re.findall(r"`([a-z_]+)`", advice) if "_" in c or c in single_words}
    # The orchestrator reports its own codes and the config sections' (cfg.problems()).
    files = [*(REPO / "orchestrator").rglob("*.py"), *(REPO / "trainer" / "config").glob("*.py")]
    source = "".join(p.read_text() for p in files)
    assert len(codes) >= 10, codes
    assert sorted(c for c in codes if f'"{c}"' not in source) == []


# Top-level folders whose files the docs name by path.
REPO_DIRS = ("trainer", "orchestrator", "tests", "bench", "hydra_conf", "slurm", "containers", "csrc", "docs")
# Files the docs tell users to create: examples, not references.
USER_FILES = {"hydra_conf/cluster/mysite.yaml", "containers/slipway-ngc.sif"}


def doc_references(text: str) -> dict[str, set[str]]:
    """What the docs name that must exist: ``python -m`` modules, repository paths, make targets, and
    relative Markdown links (from README.md or docs/)."""
    paths = re.findall(rf"(?<![\w./-])((?:{'|'.join(REPO_DIRS)})/[\w./-]*[\w/])", text)
    return {"modules": set(re.findall(r"python -m ([a-z_][\w.]*)", text)),
            "paths": {p for p in paths if "<" not in p and "*" not in p and p not in USER_FILES},
            "targets": set(re.findall(r"(?:`|^\s*)make ([a-z][\w-]*)", text, re.M)),
            "links": set(re.findall(r"\]\(((?!https?:|#)[^)#\s]+)", text))}


def _missing(refs: dict[str, set[str]], base: Path) -> list[str]:
    import importlib.util

    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    ours = ("trainer", "orchestrator", "tests", "bench")  # other modules (pip, wandb) are not ours to check
    out = [f"python -m {m}" for m in refs["modules"]
           if m.split(".")[0] in ours and importlib.util.find_spec(m) is None]
    out += [p for p in refs["paths"] if not (REPO / p).exists()]
    out += [f"make {t}" for t in refs["targets"] if t not in targets]
    out += [f"link {link}" for link in refs["links"] if not (base / link).exists()]
    return sorted(out)


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in (REPO / "docs").glob("*.md"))])
def test_every_module_path_target_and_link_a_doc_names_exists(page):
    """A doc that names a module, a file, a make target or a page that does not exist (renamed, moved,
    removed) fails here: README.md and every page of docs/."""
    path = REPO / page if page == "README.md" else REPO / "docs" / page
    refs = doc_references(path.read_text(encoding="utf-8"))
    assert _missing(refs, path.parent) == []


def test_the_reference_check_sees_what_it_looks_for():
    refs = doc_references("run `python -m trainer.nothing_here` (see `trainer/health.py`), `make tset`, "
                          "[the runbook](docs/nowhere.md) and [ok](README.md)")
    assert _missing(refs, REPO) == ["docs/nowhere.md", "link docs/nowhere.md", "make tset",
                                    "python -m trainer.nothing_here", "trainer/health.py"]


def test_one_word_for_a_runs_cost():
    """Issue 52 item 8: the plan said "GPU-hours" (or "CPU-task-hours"), the docs "device-hours"; the one
    term is DEVICE_HOURS, in what Slipway prints and in what users read."""
    from orchestrator.base.estimate import DEVICE_HOURS

    assert DEVICE_HOURS == "device-hours"
    code = "\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "orchestrator").rglob("*.py")))
    for text in (user_docs(), code, (REPO / "launch.py").read_text(encoding="utf-8")):
        assert not re.search(r"(GPU|CPU-task|task)[- ]hours", text, re.I)
    assert "device-hours" in user_docs() and code.count("DEVICE_HOURS") >= 3  # defined, plan, sweep
