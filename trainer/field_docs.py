"""How a dataclass field is documented in this codebase, read from the source: the string literal after
the field (the house style), else the comment ending its line. One reader for the configuration
reference (orchestrator/docs.py) and the generated command lines' help (trainer/cli.py). Torch-free."""

from __future__ import annotations

import ast


def class_field_docs(node: ast.ClassDef, comments: dict[int, str] | None = None
                     ) -> dict[str, tuple[str, str | None]]:
    """Per annotated field of ``node``'s body: (its annotation as written, its documentation or None).
    ``comments`` (source line → comment text) supplies the end-of-line fallback."""
    out: dict[str, tuple[str, str | None]] = {}
    body = node.body
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        doc, literal = None, None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            literal = nxt.value.value
        if isinstance(literal, str):
            doc = " ".join(literal.split()) or None
        elif comments and stmt.end_lineno in comments:
            doc = comments[stmt.end_lineno] or None
        out[stmt.target.id] = (ast.unparse(stmt.annotation), doc)
    return out
