"""trainer.run_files is the one place that names a file of a run: the launcher, the trainer and the
status table ask it. Read from the source with ``ast`` (docstrings and comments may name files)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from trainer import run_files
from trainer.run_files import RunDir, document_prefix

ROOT = Path(__file__).resolve().parents[1]
OWNER = ROOT / "trainer" / "run_files.py"
# Names distinctive enough that any string holding them is a copy (a path, a message, a shell line).
DISTINCT = [run_files.RUN_JSON, run_files.WANDB_RUN, run_files.METRICS, run_files.DATA_REPORT,
            run_files.SAMPLE, run_files.LOSS_PLOT, run_files.SUMMARY, run_files.COMPLETE, run_files.FAILED,
            run_files.ATTEMPT_ENV, run_files.ALLOC_START_ENV, run_files.BAD_NODES, run_files.LAYOUT_TABLE,
            run_files.LAYOUT_TABLE_TEXT,
            run_files.TRIAL_SPEC, "trial_rank", run_files.JOB_RECORD, run_files.LAUNCH_LOCK,
            run_files.CKPT_WRITER, run_files.HANGS, "_log.", "fatal_{", "stopped_{"]
# The dataset-prefix rule: an f-string part that starts with it ("{prefix}_{key}_document").
PREFIX_RULE = "_document"
# Folder names that are also ordinary words (the "eval" stage, a "logs" key): a copy is one used as a
# path component, ``x / "checkpoints"`` or ``os.path.join(x, "checkpoints")``.
FOLDERS = {run_files.CHECKPOINTS, run_files.HF, run_files.EVAL, run_files.LOGS, run_files.JOBS,
           run_files.STAGES, run_files.LAUNCHES, run_files.REQUEUES, run_files.RETRIES, run_files.CONFIG,
           run_files.PIDS, run_files.BAD_NODES_DIR, run_files.EXCLUSIONS, run_files.TUNE,
           run_files.HEARTBEATS, run_files.GOODPUT, run_files.COMPILE_CACHE}


def _docstrings(tree: ast.AST) -> set[int]:
    """Bare string statements: docstrings, and the attribute docstrings of config fields."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


def _constants(tree: ast.Module) -> dict[str, str]:
    """The module's and its classes' constants holding a string (``LOGS_DIR = "logs"``), by name."""
    out = {}
    for body in [tree.body, *(c.body for c in tree.body if isinstance(c, ast.ClassDef))]:
        for node in body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            value = getattr(node, "value", None)
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.update({t.id: value.value for t in targets if isinstance(t, ast.Name)})
    return out


def _path_parts(node: ast.AST) -> list[ast.AST]:
    """The operands that a node joins into a path: ``a / b``, ``os.path.join(a, b, ...)``, ``Path(a, b)``,
    ``p.joinpath(b, ...)``, and the literal pieces of an f-string, split at its slashes, and the values it
    puts between slashes."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return [node.left, node.right]
    if isinstance(node, ast.JoinedStr):  # f"{run_dir}/checkpoints/...": a piece after a value, from a "/"
        pieces = [b.value for a, b in zip(node.values, node.values[1:], strict=False)
                  if isinstance(a, ast.FormattedValue) and isinstance(b, ast.Constant) and b.value[:1] == "/"]
        values = [v.value for i, v in enumerate(node.values) if isinstance(v, ast.FormattedValue) and i
                  and isinstance(node.values[i - 1], ast.Constant) and node.values[i - 1].value.endswith("/")]
        return [*values, *(ast.Constant(part) for piece in pieces for part in piece.split("/"))]
    if not isinstance(node, ast.Call):
        return []
    func = ast.unparse(node.func)
    if func in ("os.path.join", "path.join", "Path", "pathlib.Path") or func.endswith(".joinpath"):
        return list(node.args)
    return []


def copies(source: str, name: str) -> list[str]:
    """``line: text`` of each place in ``source`` that names a run file outside run_files: in a literal,
    or as a path part, a literal or a module or class constant holding one (``LOGS_DIR = "logs"``, then
    ``run_dir / LOGS_DIR`` or ``f"{run}/{self.LOGS_DIR}"``)."""
    tree = ast.parse(source, name)
    docs, found, constants = _docstrings(tree), [], _constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found += [f"{name}:{node.lineno}: {d!r}" for d in DISTINCT if d in node.value]
            if node.value.startswith(PREFIX_RULE):
                found.append(f"{name}:{node.lineno}: the prefix rule {node.value!r}")
        for part in _path_parts(node):
            ref = part.id if isinstance(part, ast.Name) else part.attr if isinstance(part, ast.Attribute) \
                else None
            value = part.value if isinstance(part, ast.Constant) else constants.get(ref)
            if value in FOLDERS:
                held = f" (held by {ref})" if ref else ""
                found.append(f"{name}:{node.lineno}: path part {value!r}{held}")
    return found


def test_no_module_but_run_files_names_a_file_of_a_run():
    offenders = []
    for path in sorted([*(ROOT / "trainer").rglob("*.py"), *(ROOT / "orchestrator").rglob("*.py"),
                        *(ROOT / "hydra_plugins").rglob("*.py"), ROOT / "launch.py"]):
        if path != OWNER:
            offenders += copies(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert offenders == [], "name these through trainer.run_files (RunDir):\n" + "\n".join(offenders)


def test_the_check_sees_each_kind_of_copy():
    """The scan above is only as good as what it recognises: a literal, a path join, an f-string."""
    assert copies('p = run_dir / "checkpoints"', "a.py")
    assert copies('p = os.path.join(run_dir, "logs")', "a.py")
    assert copies('p = f"{run}/wandb_run.json"', "a.py")
    assert copies('p = f"{prefix}_{key}_document"', "a.py")
    assert copies('p = Path(run_dir, "checkpoints")', "a.py")
    assert copies('p = run.joinpath("stages", stage)', "a.py")
    assert copies('p = f"{run_dir}/heartbeats/rank_{r}.json"', "a.py")
    assert copies('p = folder.glob(f"{job}_*_log.err")', "a.py")
    assert not copies('words = f"the {stage} stage logs"; m = f"eval/{name}"', "a.py")
    # a module or class constant holding a folder's name, joined later
    assert copies('LOGS_DIR = "logs"\ndef f(run):\n    return run / LOGS_DIR', "a.py")
    assert copies('CKPT = "checkpoints"\ndef f(run):\n    return os.path.join(run, CKPT, "x")', "a.py")
    assert copies('class P:\n    HF_DIR = "hf"\n    def f(self, run):\n        return f"{run}/{self.HF_DIR}"',
                  "a.py")
    assert copies('NAME: str = "run.json"', "a.py")  # a distinctive name, wherever it is held
    assert not copies('STAGE = "eval"\nrow = {"stage": STAGE}\np = run / name', "a.py")
    assert not copies('"""run.json: what was launched"""\nstage = "eval"', "a.py")


def test_run_dir_paths_and_the_prefix_rule():
    run = RunDir("/runs/r1")
    assert run.checkpoints == Path("/runs/r1/checkpoints") and run.stage_state("train") == Path(
        "/runs/r1/stages/train")
    assert run.metrics.name == "train_metrics.jsonl" and run.jobs("eval") == Path("/runs/r1/jobs/eval")
    # Megatron's preprocess_data.py names its output {output_prefix}_{json_key}_document
    assert document_prefix("/data/codeparrot", "content") == "/data/codeparrot_content_document"


def test_the_contract_loads_no_torch():
    code = "import sys, trainer.run_files; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
