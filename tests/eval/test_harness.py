"""The HumanEval harness with stand-in "models": the canonical solutions pass every problem, ``pass``
passes none, and hostile completions (an endless loop, unbounded allocation, a fork bomb, a daemon that
outlives its program, a socket, a secret from the environment, a huge file) are contained and count as
failures. Real subprocesses in the real sandbox; the pass@k estimator against the closed form."""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import uuid

import pytest

from trainer.eval.humaneval import evaluate, load_problems, pass_at_k, program, truncate
from trainer.eval.sandbox import Limits, isolation, run_program

LIMITS = Limits(timeout_s=3.0, memory_mb=512)


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


HOSTILE = {
    "endless loop": "while True:\n    pass",
    "unbounded allocation": "hog = []\nwhile True:\n    hog.append(bytearray(50_000_000))",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "huge file": "with open('big', 'wb') as f:\n    f.write(b'x' * 100_000_000)",
    "secret from the environment": "import os\nassert os.environ['SLIPWAY_TEST_SECRET_TOKEN']",
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_completions_are_contained_and_fail(problems, what, monkeypatch):
    monkeypatch.setenv("SLIPWAY_TEST_SECRET_TOKEN", "hf_" + "s" * 34)  # in the evaluating process only
    p = problems[0]
    started = time.monotonic()
    res = evaluate([p], _fixed(lambda _: _hostile(p, HOSTILE[what])), 0.2, [1], 1, LIMITS)
    assert res.correct == {p["task_id"]: 0}, what
    assert time.monotonic() - started < LIMITS.timeout_s + 5


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
    out = run_program(program(p, _hostile(p, daemon)), LIMITS)
    time.sleep(0.5)
    level = isolation()[0]
    if "pidns" not in level:
        pytest.skip(f"no PID namespace here ({level}): a setsid daemon escapes the process group")
    assert _processes_with(token) == [], (out, level)


def test_a_socket_to_a_listening_server_is_refused(problems):
    level = isolation()[0]
    if "netns" not in level:
        pytest.skip(f"no network namespace here ({level})")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []
    server.settimeout(6)

    def accept() -> None:
        try:
            accepted.append(server.accept()[0])
        except OSError:  # nobody came: the expected outcome
            pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    p = problems[0]
    dial = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')"
    res = evaluate([p], _fixed(lambda _: _hostile(p, dial)), 0.2, [1], 1, LIMITS)
    t.join(7)
    server.close()
    assert res.correct == {p["task_id"]: 0} and accepted == []


def test_the_working_directory_is_empty_and_the_environment_clean():
    probe = ("import os, sys\nassert os.listdir('.') == [], os.listdir('.')\n"
             "assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'LC_CTYPE'}, sorted(os.environ)\n"
             "assert os.environ['HOME'] == os.getcwd()\nassert sys.flags.isolated")
    assert run_program(probe, LIMITS).passed
    assert not run_program("raise SystemExit(3)", LIMITS).passed
