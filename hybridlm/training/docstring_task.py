"""A fine-tuning task made offline: docstring -> function, from the Python standard library.

Each example's prompt is a function's signature line and docstring; its response is the function's body. The
functions of :data:`hybridlm.training.corpus.HELD_OUT_STDLIB` form the evaluation set, so a model pretrained on
the default corpus has never seen them.
"""

from __future__ import annotations

import ast

from hybridlm.training.corpus import HELD_OUT_STDLIB, stdlib_root

MAX_CHARS = 1200  # longer functions are skipped: the task stays small and fits short rows


def _examples_in(source: str) -> list[dict]:
    """``{"prompt", "response"}`` for every documented function of ``source`` short enough to keep."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    examples = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        docstring, body = node.body[0], node.body[1:]
        if not body or node.end_lineno - node.lineno > 60:
            continue
        first_line = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        prompt = "".join(lines[first_line - 1:docstring.end_lineno])
        response = "".join(lines[docstring.end_lineno:node.end_lineno])
        if response.strip() and len(prompt) + len(response) <= MAX_CHARS:
            examples.append({"prompt": prompt, "response": response})
    return examples


def docstring_examples(held_out: bool) -> list[dict]:
    """The task's training examples (``held_out=False``: every stdlib file outside the held-out set, in sorted
    order) or its evaluation examples (the held-out files)."""
    root = stdlib_root()
    files = ([root / name for name in HELD_OUT_STDLIB] if held_out else
             [p for p in sorted(root.glob("*.py")) if p.name not in HELD_OUT_STDLIB])
    examples = []
    for path in files:
        if path.is_file():
            examples += _examples_in(path.read_text(encoding="utf-8", errors="replace"))
    if not examples:
        raise FileNotFoundError(f"no documented functions found in the standard library under {root}")
    return examples

