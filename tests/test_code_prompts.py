"""Coding requests from Python source (`train/code_prompts.py`) as a training-data source."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from dflash_core.train.code_prompts import TEMPLATES, functions_in, iter_code_prompts
from dflash_core.train.prompt_sources import load_prompts

MODULE = textwrap.dedent('''
    import functools

    @functools.cache
    def scale(values, factor=2):
        """Multiply every value by factor and return the new list, keeping the order."""
        out = [v * factor for v in values]
        return out

    def total(values):
        """Add up the values and return the sum, or zero for an empty sequence."""
        result = sum(values)
        return result

    def _private(x):
        """A private helper that is long enough to be documented properly here."""
        return x

    def undocumented(x):
        return x + 1

    def short_doc(x):
        """Too short."""
        return x

    def only_doc():
        """A docstring and nothing else: there is nothing here to implement at all."""

    def abstract(x):
        """An abstract hook that subclasses must override with their own version."""
        raise NotImplementedError

    class Account:
        """An account."""

        def deposit(self, amount):
            """Add amount to the balance and return the new balance of the account."""
            self.balance += amount
            return self.balance

        def _hidden(self):
            """A private method with a docstring that is long enough to count."""
            return 1
''')


PINNED_TEMPLATES = [0, 4, 0]


def write_tree(root: Path) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "money.py").write_text(MODULE)
    (root / "tests").mkdir()
    (root / "tests" / "test_money.py").write_text(MODULE)  # tests are not library functions
    (root / "broken.py").write_text("def oops(:\n")  # unparsable: skipped, not fatal
    (root / "_private_module.py").write_text(MODULE)  # an implementation detail, not an API
    (root / "turtle.py").write_text(MODULE)  # GUI code


def test_functions_in_keeps_documented_public_functions_and_methods(tmp_path: Path) -> None:
    write_tree(tmp_path)
    found = {name: (stub, src) for name, stub, src in functions_in(tmp_path / "pkg" / "money.py", "pkg.money")}
    assert sorted(found) == ["pkg.money.Account.deposit", "pkg.money.scale", "pkg.money.total"]
    stub, src = found["pkg.money.scale"]
    assert stub.startswith("def scale(values, factor=2):") and "@functools" not in stub
    assert stub.rstrip().endswith('keeping the order."""') and "return out" not in stub  # no body in the request
    assert "return out" in src  # the dataset's own answer is the whole function
    stub, src = found["pkg.money.Account.deposit"]
    assert stub.startswith("class Account:\n    def deposit(self, amount):")
    assert "self.balance += amount" in src and "self.balance" not in stub
    ast.parse(src)  # the answer is valid Python on its own


def test_iter_code_prompts_skips_tests_and_is_stable(tmp_path: Path) -> None:
    write_tree(tmp_path)
    prompts = list(iter_code_prompts(tmp_path))
    tag = f"pycode:{tmp_path.resolve().name}:"  # another folder's ids never collide with the stdlib's
    assert [p.id for p in prompts] == [f"{tag}pkg.money.{n}" for n in ("scale", "total", "Account.deposit")]
    for p in prompts:
        assert any(p.text == t.format(stub=p.text.split("```python\n")[1].split("\n```")[0]) for t in TEMPLATES)
        assert p.answer and not p.history
    # The phrasing follows a fixed hash of the name (not Python's salted hash()): pinned, so it never changes.
    assert [TEMPLATES.index(next(t for t in TEMPLATES if p.text.startswith(t.split("{stub}")[0])))
            for p in prompts] == PINNED_TEMPLATES


def test_form_feeds_do_not_shift_functions(tmp_path: Path) -> None:
    # Old sources separate sections with a form feed, which str.splitlines() (not ast) counts as a line break.
    (tmp_path / "paged.py").write_text('import os\n\x0c\ndef alpha(x):\n    """Return x plus one, for the '
                                       'page-separated module test."""\n    y = x + 1\n    return y\n')
    [(name, stub, src)] = list(functions_in(tmp_path / "paged.py", "paged"))
    assert name == "paged.alpha"
    assert stub.startswith("def alpha(x):") and stub.rstrip().endswith('test."""')
    assert src.rstrip().endswith("return y")


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no folder of Python source"):
        list(iter_code_prompts(tmp_path / "nowhere"))


def test_pycode_source_is_decontaminated(tmp_path: Path) -> None:
    write_tree(tmp_path)
    # A HumanEval problem's signature in a source tree must not become training data.
    (tmp_path / "pkg" / "leak.py").write_text(textwrap.dedent('''
        def has_close_elements(numbers: List[float], threshold: float) -> bool:
            """Check if in given list of numbers, are any two numbers closer to each other than threshold."""
            return any(abs(a - b) < threshold for a in numbers for b in numbers if a is not b)
    '''))
    stats: dict[str, int] = {}
    prompts = load_prompts(f"pycode:{tmp_path}", stats=stats)
    assert stats["eval_overlap"] == 1
    assert sorted(p.id.rsplit(":", 1)[1] for p in prompts) == [
        "pkg.money.Account.deposit", "pkg.money.scale", "pkg.money.total"]


def test_python_stdlib_source_gives_thousands_of_requests() -> None:
    prompts = load_prompts("python-stdlib")
    assert len(prompts) > 1000
    assert len({p.id for p in prompts}) == len(prompts)
    assert all("```python\n" in p.text and p.answer for p in prompts)
    assert not any(".test." in p.id or p.id.startswith("py:test") for p in prompts)
