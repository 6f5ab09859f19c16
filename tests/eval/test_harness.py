"""The HumanEval harness with stand-in "models": the canonical solutions pass every problem, ``pass``
passes none, and hostile completions (an endless loop, unbounded allocation, a fork bomb, a daemon that
outlives its program, a socket, a secret from the environment, a huge file) are contained and count as
failures. Real subprocesses in the real sandbox; the pass@k estimator against the closed form."""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
import threading
import uuid

import pytest

from tests.ci import skip_unless_ci
from tests.waits import NEVER_S, wait_until
from trainer.eval.humaneval import evaluate, load_problems, pass_at_k, program, truncate
from trainer.eval.sandbox import Limits, isolation, run_program

# A program that should finish is never judged by how fast this machine runs it: the time limit is the
# generous bound. Only the endless loop, whose verdict *is* the limit, gets a short one.
LIMITS = Limits(timeout_s=NEVER_S, memory_mb=512)
SHORT = Limits(timeout_s=3.0, memory_mb=512)


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    return load_problems()


def _fixed(answer):
    """A completer that writes ``answer(prompt)`` for every sample."""
    return lambda prompts, temperature: [answer(p) for p in prompts]


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (5, 2, 4), (10, 3, 5),
                                   (200, 0, 100), (200, 7, 1), (200, 7, 10), (200, 7, 100), (200, 150, 100),
                                   (200, 200, 100)])
def test_pass_at_k_equals_the_closed_form(n, c, k):
    closed = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(closed, rel=1e-12, abs=1e-15)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 is the fraction correct


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(5, 6, 1), (5, 1, 6), (5, 1, 0), (3, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_truncate_stops_at_the_first_stop_sequence():
    assert truncate("    return x\n\ndef other():\n    pass") == "    return x\n"
    assert truncate("    return x\nprint(f(1))\n#") == "    return x"
    assert truncate("    return 1") == "    return 1"


def test_canonical_solutions_pass_every_problem_and_pass_none(problems):
    oracle = {p["prompt"]: p["canonical_solution"] for p in problems}
    assert len(problems) == 164
    # The canonical solutions contain "\nif"/"\n#" lines inside functions? Truncation must keep them whole.
    res = evaluate(problems, _fixed(oracle.__getitem__), 0.2, [1], 1, LIMITS, workers=2)
    assert res.pass_at == {"pass@1": 1.0}, [t for t, c in res.correct.items() if not c]
    assert res.statuses == {"passed": 164}
    nothing = evaluate(problems[:20], _fixed(lambda p: "    pass\n"), 0.8, [1, 2], 2, LIMITS)
    assert nothing.pass_at == {"pass@1": 0.0, "pass@2": 0.0} and nothing.statuses == {"failed": 40}


def test_pass_counts_per_problem_give_the_estimate(problems):
    """Half the samples right on one problem, all on another: per-problem counts and pass@k from them."""
    two = problems[:2]
    answers = {two[0]["prompt"]: iter([two[0]["canonical_solution"], "    pass\n"] * 2),
               two[1]["prompt"]: iter([two[1]["canonical_solution"]] * 4)}
    res = evaluate(two, _fixed(lambda p: next(answers[p])), 0.6, [1, 2], 4, LIMITS)
    assert res.correct == {two[0]["task_id"]: 2, two[1]["task_id"]: 4}
    assert res.pass_at["pass@1"] == pytest.approx((0.5 + 1.0) / 2)
    assert res.pass_at["pass@2"] == pytest.approx((1 - math.comb(2, 2) / math.comb(4, 2) + 1.0) / 2)


def _hostile(problem: dict, body: str) -> str:
    """A completion for ``problem`` that runs ``body`` first, then returns the right answer (so only the
    sandbox makes it fail)."""
    indented = "".join(f"    {line}\n" for line in body.strip().splitlines())
    return indented + problem["canonical_solution"]


def _processes_with(token: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


HOSTILE = {  # what each does, the limits it runs under, and how it must end (status, a word of its detail)
    "endless loop": ("while True:\n    pass", SHORT, "timeout", "killed after 3 s"),
    "unbounded allocation": ("hog = []\nwhile True:\n    hog.append(bytearray(50_000_000))", LIMITS, "failed",
                             "MemoryError"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", LIMITS, "failed", "BlockingIOError"),
    "huge file": ("with open('big', 'wb') as f:\n    f.write(b'x' * 100_000_000)", LIMITS, "failed",
                  "File too large"),
    "secret from the environment": ("import os\nassert os.environ['SLIPWAY_TEST_SECRET_TOKEN']", LIMITS,
                                    "failed", "KeyError"),
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_completions_are_contained_and_fail(problems, what, monkeypatch):
    """Each fails, and for its own reason: a limit that ended it for another (a slow machine's timeout)
    would prove nothing about containment."""
    monkeypatch.setenv("SLIPWAY_TEST_SECRET_TOKEN", "hf_" + "s" * 34)  # in the evaluating process only
    body, limits, status, because = HOSTILE[what]
    p = problems[0]
    res = evaluate([p], _fixed(lambda _: _hostile(p, body)), 0.2, [1], 1, limits)
    assert res.correct == {p["task_id"]: 0} and res.statuses == {status: 1}, (what, res.statuses)
    out = run_program(program(p, _hostile(p, body)), limits)
    assert (out.status, because in out.detail) == (status, True), (what, out)


def test_the_secret_is_not_in_any_process_the_program_can_see(problems, monkeypatch):
    secret = "hf_" + uuid.uuid4().hex + "abcd"
    monkeypatch.setenv("SLIPWAY_TEST_SECRET_TOKEN", secret)
    p = problems[0]
    look = ("import os\nseen = ''\nfor pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try:\n        seen += open('/proc/' + pid + '/environ', 'rb').read().decode('latin-1')\n"
            "    except OSError:\n        pass\n"
            f"assert {secret!r} in seen")
    res = evaluate([p], _fixed(lambda _: _hostile(p, look)), 0.2, [1], 1, LIMITS)
    assert res.correct == {p["task_id"]: 0}


def test_a_forked_daemon_does_not_outlive_its_program(problems):
    token = f"slipway-daemon-{uuid.uuid4().hex}"
    p = problems[0]
    daemon = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n"
              "    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', "
              f"{token!r}])")
    level = isolation()[0]
    if "pidns" not in level:
        skip_unless_ci(f"no PID namespace here ({level}): a setsid daemon escapes the process group")
    out = run_program(program(p, _hostile(p, daemon)), LIMITS)
    assert out.passed, out  # the program itself returned at once, leaving its daemon behind
    # The namespace's init took the daemon with it; the kernel reaps it asynchronously, so wait for that.
    wait_until(lambda: _processes_with(token) == [], f"the daemon to be gone ({out}, {level})")


def test_a_socket_to_a_listening_server_is_refused(problems):
    level = isolation()[0]
    if "netns" not in level:
        skip_unless_ci(f"no network namespace here ({level})")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    p = problems[0]
    dial = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')"
    res = evaluate([p], _fixed(lambda _: _hostile(p, dial)), 0.2, [1], 1, LIMITS)
    # The program has ended: a connection it made would be waiting in the listen backlog now.
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()
    assert res.correct == {p["task_id"]: 0} and res.statuses == {"failed": 1}, res.statuses


def test_the_working_directory_is_empty_and_the_environment_clean():
    probe = ("import os, sys\nassert os.listdir('.') == [], os.listdir('.')\n"
             "assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'LC_CTYPE'}, sorted(os.environ)\n"
             "assert os.environ['HOME'] == os.getcwd()\nassert sys.flags.isolated")
    assert run_program(probe, LIMITS).passed
    assert not run_program("raise SystemExit(3)", LIMITS).passed


def test_a_fork_bomb_does_not_starve_the_programs_running_beside_it():
    """RLIMIT_NPROC counts a uid's processes machine-wide: with every program as ``nobody`` a fork bomb
    used up the budget of all the others running meanwhile (evaluation workers, other jobs on the node),
    which then failed to start and counted as wrong answers. Each program now has a uid of its own."""
    level = isolation()[0]
    if not level.endswith("+uid"):
        skip_unless_ci(f"programs do not drop to their own uid here ({level}): not running as root")
    token = f"slipway-bomb-{uuid.uuid4().hex}"
    stop_dir = tempfile.mkdtemp()
    os.chmod(stop_dir, 0o755)  # the bomb's uid must see the stop file appear
    stop = os.path.join(stop_dir, "stop")
    child = f"[sys.executable, '-c', 'import time; time.sleep(600)', {token!r}]"
    bomb = (f"import os, sys, time\nwhile not os.path.exists({stop!r}):\n    try:\n"
            f"        if os.fork() == 0:\n            os.execv(sys.executable, {child})\n"
            "    except BlockingIOError:\n        time.sleep(0.05)\n")
    ended = []
    thread = threading.Thread(target=lambda: ended.append(run_program(bomb, LIMITS)))
    thread.start()
    try:
        # The bomb holds (nearly) its whole process budget: the event, not a time, starts the neighbour.
        wait_until(lambda: len(_processes_with(token)) >= LIMITS.processes - 4, "the bomb to fill its budget")
        neighbour = run_program("import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
                                "assert os.waitpid(pid, 0)[1] == 0", LIMITS)
    finally:
        open(stop, "w").close()
        thread.join(NEVER_S)
        shutil.rmtree(stop_dir)
    assert neighbour.passed, neighbour
    assert ended and ended[0].passed, ended  # the bomb itself stopped when told, its processes with it
    wait_until(lambda: _processes_with(token) == [], "the bomb's processes to be gone")
