"""Coding requests built from Python source: "implement this function", for training data.

ShareGPT's chats are mostly prose, and a drafter trained on them drafts code worse than prose
(chain tau 1.40 on HumanEval against 1.67 on GSM8K with an earlier drafter). Any Python tree
holds thousands of documented functions; each becomes one request whose prompt is the
function's stub (signature and docstring, inside its class for a method) under one of a few
phrasings, and whose `answer` is the function's own source (for `answers.py`). The target then
writes its own implementation (`data.py generate --source python-stdlib`), which is what the
drafter must learn to predict. The default tree, the Python standard library, is on every
machine (offline) and PSF-licensed; `pycode:DIR` reads any other folder.

The evaluation sets stay out as for every source: `prompt_sources.load_prompts` drops any request whose
text contains a HumanEval signature or docstring.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

from .prompt import Prompt

# Varied phrasings: the drafter should learn the target's code, not one request's wording.
TEMPLATES = (
    "Complete this Python function:\n```python\n{stub}\n```",
    "Implement the following Python function.\n\n```python\n{stub}\n```",
    "Write the body of this function:\n\n```python\n{stub}\n```",
    "```python\n{stub}\n```\nFinish this function in Python and explain briefly how it works.",
    "Here is a signature and a docstring. Write the implementation.\n```python\n{stub}\n```",
)
# Modules and folders whose code is tests, demos or GUI glue rather than library functions.
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "ensurepip", "turtledemo", "tkinter", "turtle",
              "site-packages", "dist-packages", "__pycache__"}
MIN_DOC_CHARS = 40
MIN_STATEMENTS = 2  # the docstring and at least one statement: something to implement
MAX_LINES = 60
MAX_STUB_CHARS = 3000


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_placeholder(stmt: ast.stmt) -> bool:
    """`pass`, `...` or `raise NotImplementedError`: an abstract method's body, nothing to implement."""
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis:
        return True
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def _documented(node: ast.AST) -> bool:
    return (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_")
            and len(node.body) >= MIN_STATEMENTS and (node.end_lineno or node.lineno) - node.lineno < MAX_LINES
            and len(ast.get_docstring(node) or "") >= MIN_DOC_CHARS
            and not all(_is_placeholder(s) for s in node.body[1:]))


def _stub_and_source(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef,
                     cls: str | None) -> tuple[str, str]:
    """(signature through docstring, whole function), dedented, wrapped in `class cls:` for a method.
    Decorators are left out: `node.lineno` is the `def` line."""
    doc_end = node.body[0].end_lineno or node.body[0].lineno
    stub = textwrap.dedent("\n".join(lines[node.lineno - 1: doc_end]))
    source = textwrap.dedent("\n".join(lines[node.lineno - 1: node.end_lineno]))
    if cls is not None:
        stub = f"class {cls}:\n" + textwrap.indent(stub, "    ")
        source = f"class {cls}:\n" + textwrap.indent(source, "    ")
    return stub, source


def functions_in(path: Path, module: str) -> Iterator[tuple[str, str, str]]:
    """(qualified name, stub, source) of the documented public functions and methods of one file."""
    try:
        text = path.read_text(encoding="utf-8-sig")
        tree = ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return  # not Python 3 source we can read: nothing to ask about
    # ast counts lines at "\n" only; str.splitlines would also split at form feeds and the like.
    lines = text.split("\n")
    for node in tree.body:
        if _documented(node):
            yield (f"{module}.{node.name}", *_stub_and_source(lines, node, None))  # type: ignore[arg-type]
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if _documented(sub):
                    yield (f"{module}.{node.name}.{sub.name}",  # type: ignore[union-attr]
                           *_stub_and_source(lines, sub, node.name))  # type: ignore[arg-type]


def iter_code_prompts(root: str | Path | None = None) -> Iterator[Prompt]:
    """One request per documented public function or method (of a top-level class) under `root`
    (default: the standard library), in file order; private modules (`_name.py`), tests, demos
    and GUI code are left out. The phrasing is picked by a hash of the function's name, so it
    never changes. Ids are `py:<module>.<name>` for the standard library and
    `pycode:<folder name>:<module>.<name>` for another folder."""
    tag = "py:" if root is None else f"pycode:{Path(root).resolve().name}:"
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"no folder of Python source at {root}")
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if any(part in SKIP_PARTS or part.startswith("test") or (part.startswith("_") and part != "__init__")
               for part in parts):
            continue
        module = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
        for name, stub, source in functions_in(path, module):
            if len(stub) > MAX_STUB_CHARS:
                continue
            pick = int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "big") % len(TEMPLATES)
            yield Prompt(f"{tag}{name}", TEMPLATES[pick].format(stub=stub), source)
