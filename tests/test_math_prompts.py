"""Templated grade-school word problems (`train/math_prompts.py`) as a training-data source."""

from __future__ import annotations

import re

import pytest

from dflash_core.train.math_prompts import TEMPLATES, iter_math_prompts, math_problem
from dflash_core.train.prompt_sources import EvalFilter, load_prompts


def test_every_template_poses_a_whole_number_problem_on_many_draws() -> None:
    seen = set()
    for k in range(len(TEMPLATES) * 40):
        name, text, value = math_problem(k)
        seen.add(name)
        assert isinstance(value, int) and value > 0, (name, text, value)
        assert text.rstrip().endswith(("?", ".")) and "{" not in text and "}" not in text, text
        assert re.search(r"\d", text), text  # numbers to compute with
    assert seen == {t.__name__ for t in TEMPLATES}


@pytest.mark.parametrize("k", [0, 7, 123])
def test_answers_follow_the_numbers_in_the_text(k: int) -> None:
    # Spot checks by reading the numbers back out of the text, independent of the templates' code.
    idx = k * len(TEMPLATES) + [t.__name__ for t in TEMPLATES].index("farm_legs")
    _, text, value = math_problem(idx)
    x, a1, y, a2 = re.search(r"there are (\d+) (\w+) and (\d+) (\w+)\.", text).groups()
    legs = {"chickens": 2, "ducks": 2, "cows": 4, "goats": 4, "sheep": 4, "pigs": 4}
    assert value == int(x) * legs[a1] + int(y) * legs[a2]
    idx = k * len(TEMPLATES) + [t.__name__ for t in TEMPLATES].index("trip")
    _, text, value = math_problem(idx)
    v1, t1, v2, t2 = map(int, re.search(r"at (\d+) miles per hour for (\d+) hours, then at (\d+) miles per hour "
                                        r"for (\d+) more hours", text).groups())
    assert value == v1 * t1 + v2 * t2


def _draws(template: str, n: int) -> list[tuple[str, int]]:
    t = [t.__name__ for t in TEMPLATES].index(template)
    return [math_problem(k * len(TEMPLATES) + t)[1:] for k in range(n)]


def test_money_and_people_problems_read_back() -> None:
    # Independent read-backs of the templates whose numbers must divide evenly.
    for text, value in _draws("discount", 500):
        price, off, count = map(int, re.search(r"costs \$(\d+)\. .* takes (\d+)% off\. \w+ buys (\d+)", text).groups())
        assert price * (100 - off) % 100 == 0 and value == price * (100 - off) // 100 * count
    for text, value in _draws("classroom", 500):
        students, pct, club = map(int, re.search(r"(\d+) students .* (\d+)% .*\. (\d+) of the girls", text).groups())
        assert students * pct % 100 == 0 and value == students * pct // 100 - club > 0
    for text, value in _draws("comparison", 500):
        fewer, base = map(int, re.search(r"has (\d+) fewer .* has (\d+) ", text).groups())
        times = {"twice": 2, "three times": 3, "four times": 4}[re.search(r"has (twice|\w+ times) as many", text)[1]]
        assert times * base - fewer >= 1 and value == base + 2 * times * base - fewer
    for text, value in _draws("average", 500):
        listed, mean = re.search(r"were ([\d, and]+)\. .* exactly (\d+)\?", text).groups()
        scores = [int(x) for x in re.findall(r"\d+", listed)]
        assert value <= 100 and (sum(scores) + value) == int(mean) * (len(scores) + 1)


def test_shopping_always_has_a_big_enough_bill() -> None:
    for text, value in _draws("shopping", 5000):  # the dearest basket is 1 in ~2,600 draws
        bill = int(re.search(r"pays with a \$(\d+) bill", text)[1])
        assert 0 < value < bill


def test_prompts_are_reproducible_varied_and_clean() -> None:
    a = list(iter_math_prompts(600))
    assert [p.text for p in a] == [p.text for p in iter_math_prompts(600)]  # same prompts on a rerun
    assert len({p.id for p in a}) == 600 and len({p.text for p in a}) > 580
    assert [p.text for p in iter_math_prompts(600, seed=1)] != [p.text for p in a]
    filt = EvalFilter.default()
    assert not any(filt.hit(p.text) for p in a)  # nothing taken from GSM8K


def test_source_name_and_count() -> None:
    stats: dict[str, int] = {}
    prompts = load_prompts("synthetic-math:300", stats=stats)
    assert stats["read"] == 300 and stats["kept"] == len(prompts) >= 290
    assert all(p.id.startswith("math:") for p in prompts)
    for bad in ("synthetic-math:many", "synthetic-math:0", "synthetic-math:"):
        with pytest.raises(ValueError, match="number of prompts"):
            load_prompts(bad)
