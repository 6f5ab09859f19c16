"""What a secret looks like, and how it is kept out of everything Slipway writes or prints (torch-free).

One definition, used by the checks (orchestrator/checks/secrets.py refuses a secret in the config),
rendering (a secret-named variable is forwarded by reference, never by value), ``run.json`` and
``config.yaml``, the dry run and every line the launch prints (its streams and the ``slipway`` loggers'
handlers):

- **Names**: a variable or key with a word of :data:`SECRET_WORDS`, or ``KEY`` after a qualifier
  (``DB_PASSWD``, ``wandb_api_key``, ``--api-key``), holds a secret; ``max_new_tokens`` does not.
- **Values**: text matching one of :data:`VALUE_PATTERNS` is a secret wherever it appears (Hugging Face,
  GitHub and AWS tokens, PEM private keys: shapes specific enough never to match a path or a name).
  :data:`HEX40` (a W&B API key) is also a git sha and a Hugging Face snapshot folder, so it counts only
  where a secret may sit: the values of ``cluster.env``, ``cluster.sbatch_extra`` and ``cluster.setup``.
- **Assignments**: in any text, ``NAME=value`` with a secret ``NAME`` (``export GITHUB_TOKEN=...``,
  Hydra's ``+cluster.env.DB_PASSWD=...``) hides the value; ``NAME=$REF`` (a reference) is kept.

The process has one :data:`REDACTOR` that collects the known secret values (the launching environment's
secret-named variables, the command line's secret overrides, the secrets found in the config) and
replaces them, then the patterns. :func:`install` puts it on ``sys.stdout``/``sys.stderr`` and on the
logging handlers, so Hydra's and Python's own error output is covered too.
"""

from __future__ import annotations

import io
import logging
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

VALUE_PATTERNS = {
    "hf_token": re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"),
    "github_token": re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})\b"),
    "aws_access_key": re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"),
    "private_key": re.compile(
        r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----.*?(?:-----END \1PRIVATE KEY-----|\Z)", re.S
    ),
}
HEX40 = re.compile(r"\b[0-9a-f]{40}\b")  # a W&B API key; only where a secret may sit (see above)
ASSIGNMENT = re.compile(r"(?P<name>[A-Za-z_][\w.\-]*)=(?P<quote>['\"]?)(?P<value>[^\s'\",\])}]+)")
MIN_KNOWN = 4  # shorter secret values are not searched for in text (they would hide ordinary words)


# A name is split into words (``_``, ``-``, ``.`` and camelCase boundaries); a secret is a word in
# SECRET_WORDS, or the word KEY after one of KEY_QUALIFIERS (WANDB_API_KEY, AWS_SECRET_ACCESS_KEY). Whole
# words, so max_new_tokens, tokenizer, data.json_key or sort_keys are not secrets.
SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "APIKEY", "PASS"}
KEY_QUALIFIERS = {"API", "ACCESS", "SECRET", "PRIVATE", "AUTH", "SESSION", "SSH", "SIGNING", "ENCRYPTION",
                  "LICENSE", "MASTER", "ACCOUNT"}
_WORD_BREAK = re.compile(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])")


def is_secret_name(name: str) -> bool:
    """``name`` (a variable, flag or dotted key; its last component counts) names a secret."""
    words = [w.upper() for w in _WORD_BREAK.split(name.rsplit(".", 1)[-1]) if w]
    return any(w in SECRET_WORDS or (w == "KEY" and i > 0 and words[i - 1] in KEY_QUALIFIERS)
               for i, w in enumerate(words))


def secret_kind(value: str, secret_position: bool = False) -> str | None:
    """The pattern ``value`` contains (its label), if any; ``secret_position``: also the 40-hex keys."""
    for label, pattern in VALUE_PATTERNS.items():
        if pattern.search(value):
            return label
    if secret_position and HEX40.search(value):
        return "hex40_key"
    return None


def secret_assignments(text: str) -> list[tuple[str, str]]:
    """(name, value) of every ``NAME=value`` in ``text`` whose name is secret and whose value is literal."""
    return [
        (m["name"], m["value"])
        for m in ASSIGNMENT.finditer(text)
        if is_secret_name(m["name"]) and not m["value"].startswith(("$", "<redacted"))
    ]


def environ_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """{value: name} of the secret-named variables of ``environ`` (values of at least MIN_KNOWN chars)."""
    return {v: k for k, v in environ.items() if is_secret_name(k) and v and len(v) >= MIN_KNOWN}


def argv_secrets(args: Iterable[str]) -> dict[str, str]:
    """{value: override key} of command-line overrides that carry a secret (by name or by value)."""
    out = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        value = value.strip("'\"")
        if sep and len(value) >= MIN_KNOWN and (is_secret_name(key) or secret_kind(value, True)):
            out[value] = key.lstrip("+~")
    return out


class Redactor:
    """Replaces known secret values (``<redacted:NAME>``), then pattern matches and secret assignments."""

    def __init__(self, known: Mapping[str, str] | None = None) -> None:
        self.known: dict[str, str] = dict(known or {})

    def add(self, known: Mapping[str, str]) -> None:
        self.known.update({v: k for v, k in known.items() if v and len(v) >= MIN_KNOWN})

    def __call__(self, text: str) -> str:
        for value in sorted(self.known, key=len, reverse=True):  # a value inside a longer one: longer first
            if value in text:
                text = text.replace(value, f"<redacted:{self.known[value]}>")
        for label, pattern in VALUE_PATTERNS.items():
            text = pattern.sub(f"<redacted:{label}>", text)
        return ASSIGNMENT.sub(_hide_assignment, text)

    def tree(self, obj: Any) -> Any:
        """A copy of a JSON-like tree with every string redacted."""
        if isinstance(obj, str):
            return self(obj)
        if isinstance(obj, dict):
            return {k: self.tree(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.tree(v) for v in obj]
        return obj


def _hide_assignment(m: re.Match[str]) -> str:
    if not is_secret_name(m["name"]) or m["value"].startswith(("$", "<redacted")):
        return m[0]
    return f"{m['name']}={m['quote']}<redacted>"


REDACTOR = Redactor()  # the process's one redactor (see the module docstring)


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """``text`` without the process's known secrets, the patterns, and ``environ``'s secret values."""
    if environ is None:
        return REDACTOR(text)
    one = Redactor(REDACTOR.known)
    one.add(environ_secrets(environ))
    return one(text)


class RedactingStream(io.TextIOBase):
    """A text stream that redacts every write with :data:`REDACTOR` before passing it on."""

    def __init__(self, inner: TextIO) -> None:
        self.inner = inner

    def write(self, s: str) -> int:
        self.inner.write(REDACTOR(s))
        return len(s)

    def flush(self) -> None:
        self.inner.flush()

    def isatty(self) -> bool:
        return self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.inner, "encoding", "utf-8")


def redacting(stream: TextIO) -> TextIO:
    """``stream`` wrapped in a :class:`RedactingStream` (once)."""
    return stream if isinstance(stream, RedactingStream) else RedactingStream(stream)  # type: ignore


class RedactingFilter(logging.Filter):
    """A handler filter: the formatted message and any traceback pass through :data:`REDACTOR`."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = REDACTOR(record.getMessage()), None
        if record.exc_info and not record.exc_text:
            record.exc_text = REDACTOR(logging.Formatter().formatException(record.exc_info))
        return True


def install(streams: bool = True) -> None:
    """Redact every handler of the ``slipway`` and root loggers, and (``streams``) stdout and stderr."""
    for logger in (logging.getLogger("slipway"), logging.getLogger()):
        for handler in logger.handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())
    if streams:
        sys.stdout = redacting(sys.stdout)
        sys.stderr = redacting(sys.stderr)
