"""Grade-school word problems made from templates: maths requests for training data.

ShareGPT holds few arithmetic word problems, and GSM8K (like HumanEval) is for evaluation only, so
a drafter trained on ShareGPT drafts the target's step-by-step maths worse than its prose. The
target answers such problems in a style of its own ("... which is 5 * 2 = 10 ... #### 10 The
answer is: 10"); the prompts here exist only to draw that style out of it
(`data.py generate --source synthetic-math`), so they need variety, not correctness of the
target's replies. Each template picks names, objects and numbers at random (seeded by the
prompt's index, so a rerun makes the same prompts) and chains one to four steps whose every
intermediate quantity is a whole number; `math_problem` also returns the answer, which tests use to
check the templates. Editing a template changes the texts behind its ids: replies already made
keep the prompt they answered (a data shard stores the prompt's tokens), but a top-up skips those
ids rather than asking the new texts.

The evaluation sets stay out as for every source: `prompt_sources.load_prompts` drops any prompt that
contains a GSM8K question, and these are written here, not taken from any dataset.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from .prompt import Prompt

PEOPLE = (
    ("Maya", "she", "her"), ("Liam", "he", "his"), ("Aisha", "she", "her"), ("Carlos", "he", "his"),
    ("Nora", "she", "her"), ("Kenji", "he", "his"), ("Priya", "she", "her"), ("Tom", "he", "his"),
    ("Fatima", "she", "her"), ("Oliver", "he", "his"), ("Sofia", "she", "her"), ("Mateo", "he", "his"),
    ("Grace", "she", "her"), ("Ahmed", "he", "his"), ("Chloe", "she", "her"), ("Ethan", "he", "his"),
    ("Zara", "she", "her"), ("Lucas", "he", "his"), ("Hannah", "she", "her"), ("Diego", "he", "his"),
    ("Mei", "she", "her"), ("Samuel", "he", "his"), ("Elena", "she", "her"), ("Jamal", "he", "his"),
    ("Ruby", "she", "her"), ("Noah", "he", "his"), ("Ines", "she", "her"), ("Viktor", "he", "his"),
    ("Leila", "she", "her"), ("Owen", "he", "his"), ("Amara", "she", "her"), ("Felix", "he", "his"),
    ("Julia", "she", "her"), ("Ravi", "he", "his"), ("Emma", "she", "her"), ("Marcus", "he", "his"),
)
GOODS = (("notebooks", 3), ("pencils", 1), ("sandwiches", 6), ("T-shirts", 12), ("books", 15), ("candles", 4),
         ("mugs", 8), ("toy cars", 5), ("bags of rice", 9), ("movie tickets", 11), ("plants", 7), ("posters", 10))
FRUIT = ("apples", "oranges", "lemons", "peaches", "mangoes", "pears", "plums", "bananas")
COLLECTIBLES = ("stamps", "stickers", "marbles", "baseball cards", "seashells", "coins", "comic books")
BAKED = ("cookies", "muffins", "cupcakes", "brownies", "bread rolls", "scones")
ANIMALS = (("chickens", 2), ("ducks", 2), ("cows", 4), ("goats", 4), ("sheep", 4), ("pigs", 4))
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _people(rng: random.Random, k: int) -> list[tuple[str, str, str]]:
    return rng.sample(PEOPLE, k)


def shopping(rng: random.Random) -> tuple[str, int]:
    (n, _, _), ((g1, p1), (g2, p2)) = _people(rng, 1)[0], rng.sample(GOODS, 2)
    a, b = rng.randint(2, 9), rng.randint(2, 6)
    cost = a * p1 + b * p2
    bill = next(x for x in (20, 50, 100, 200, 500) if x > cost)  # cost <= 9 * 15 + 6 * 12 = 207
    return (f"{n} buys {a} {g1} for ${p1} each and {b} {g2} for ${p2} each. {n} pays with a ${bill} bill. "
            f"How much change does {n} get back?", bill - cost)


def baking(rng: random.Random) -> tuple[str, int]:
    n, s, p = _people(rng, 1)[0]
    item = rng.choice(BAKED)
    batches, per, eaten, share = rng.randint(2, 6), rng.choice((12, 18, 24)), rng.randint(1, 5), rng.choice((2, 3))
    total = batches * per - eaten
    total -= total % share
    eaten = batches * per - total
    left = total - total // share
    frac = {2: "half", 3: "a third"}[share]
    return (f"{n} baked {batches} batches of {item} with {per} in each batch. {s.capitalize()} ate {eaten} of them "
            f"and gave {frac} of the rest to {p} neighbours. How many {item} does {n} have left?", left)


def savings(rng: random.Random) -> tuple[str, int]:
    n, s, _ = _people(rng, 1)[0]
    wage, hours, days = rng.choice((8, 10, 12, 15, 20)), rng.randint(2, 6), rng.randint(2, 5)
    weekly = wage * hours * days
    weeks = rng.randint(3, 12)
    price = weekly * weeks - rng.randint(0, weekly - 1)
    thing = rng.choice(("bike", "laptop", "guitar", "phone", "camera", "skateboard"))
    return (f"{n} earns ${wage} an hour at a part-time job. {s.capitalize()} works {hours} hours a day, {days} days "
            f"a week, and saves all of it. How many weeks will it take {n} to save enough for a {thing} that costs "
            f"${price}?", weeks)


def trip(rng: random.Random) -> tuple[str, int]:
    n, s, _ = _people(rng, 1)[0]
    v1, t1 = rng.choice((40, 45, 50, 55, 60, 65)), rng.randint(2, 5)
    v2, t2 = rng.choice((30, 35, 40, 70)), rng.randint(1, 4)
    vehicle = rng.choice(("drives", "rides the bus", "travels by train"))
    return (f"{n} {vehicle} at {v1} miles per hour for {t1} hours, then at {v2} miles per hour for {t2} more hours. "
            f"How many miles does {s} travel in total?", v1 * t1 + v2 * t2)


def ages(rng: random.Random) -> tuple[str, int]:
    (a, _, _), (b, _, _) = _people(rng, 2)
    young, gap, later = rng.randint(4, 20), rng.randint(2, 15), rng.randint(2, 10)
    return (f"{a} is {gap} years older than {b}. {b} is {young} years old now. In {later} years, what will the sum "
            f"of their ages be?", 2 * young + gap + 2 * later)


def discount(rng: random.Random) -> tuple[str, int]:
    n, s, _ = _people(rng, 1)[0]
    price, off = rng.choice((40, 60, 80, 100, 120, 200, 300)), rng.choice((10, 20, 25, 50))  # whole dollars
    count = rng.randint(2, 4)
    thing = rng.choice(("jacket", "pair of shoes", "lamp", "backpack", "board game"))
    each = price * (100 - off) // 100
    return (f"A {thing} normally costs ${price}. This week the store takes {off}% off. {n} buys {count} of them. "
            f"How much does {s} spend?", each * count)


def garden(rng: random.Random) -> tuple[str, int]:
    n, _, p = _people(rng, 1)[0]
    rows, per, lost = rng.randint(3, 12), rng.randint(4, 15), rng.randint(1, 9)
    crop = rng.choice(("tomato plants", "carrots", "sunflowers", "lettuce heads", "rose bushes"))
    return (f"{n} planted {rows} rows of {crop} in {p} garden, with {per} in each row. A storm destroyed {lost} of "
            f"them. How many {crop} are left?", rows * per - lost)


def reading(rng: random.Random) -> tuple[str, int]:
    n, s, _ = _people(rng, 1)[0]
    per, days, extra_days = rng.randint(10, 30), rng.randint(2, 6), rng.randint(2, 5)
    pages = per * days + 2 * per * extra_days
    return (f"{n}'s book has {pages} pages. {s.capitalize()} reads {per} pages a day for {days} days, then reads "
            f"twice as many pages a day. How many more days does it take {n} to finish the book?", extra_days)


def fruit_stand(rng: random.Random) -> tuple[str, int]:
    n, _, _ = _people(rng, 1)[0]
    f1, f2 = rng.sample(FRUIT, 2)
    a, b, pa, pb = rng.randint(10, 60), rng.randint(10, 60), rng.randint(1, 3), rng.randint(2, 5)
    return (f"{n} runs a fruit stand. On Saturday {n} sold {a} {f1} at ${pa} each and {b} {f2} at ${pb} each. "
            f"How much money did the stand make on Saturday?", a * pa + b * pb)


def classroom(rng: random.Random) -> tuple[str, int]:
    students = rng.choice((20, 24, 28, 32, 36, 40))  # multiples of 4: a quarter of them is whole
    pct = rng.choice((25, 50, 75))
    girls = students * pct // 100
    club = rng.randint(1, girls - 1)
    return (f"There are {students} students in a class and {pct}% of them are girls. {club} of the girls are in the "
            f"chess club. How many girls in the class are not in the chess club?", girls - club)


def collection(rng: random.Random) -> tuple[str, int]:
    n, s, p = _people(rng, 1)[0]
    item = rng.choice(COLLECTIBLES)
    start, monthly, months, gave = rng.randint(10, 80), rng.randint(3, 12), rng.randint(2, 12), rng.randint(1, 10)
    return (f"{n} has {start} {item}. {s.capitalize()} adds {monthly} {item} to {p} collection every month for "
            f"{months} months, then gives {gave} to a friend. How many {item} does {n} have now?",
            start + monthly * months - gave)


def pool(rng: random.Random) -> tuple[str, int]:
    inflow, leak = rng.randint(8, 20), rng.randint(1, 5)
    minutes = rng.randint(10, 60)
    size = (inflow - leak) * minutes
    return (f"A hose fills a tank at {inflow} gallons per minute, but the tank leaks {leak} gallons per minute. "
            f"The tank holds {size} gallons. How many minutes does it take to fill the empty tank?", minutes)


def recipe(rng: random.Random) -> tuple[str, int]:
    cups, serves, mult = rng.randint(2, 5), rng.choice((4, 6, 8)), rng.randint(2, 5)
    food = rng.choice(("pancakes", "bread", "pizza dough", "dumplings", "waffles"))
    return (f"A recipe for {food} uses {cups} cups of flour to serve {serves} people. How many cups of flour are "
            f"needed to serve {serves * mult} people?", cups * mult)


def party(rng: random.Random) -> tuple[str, int]:
    n, s, _ = _people(rng, 1)[0]
    guests, slices = rng.randint(6, 30), rng.randint(2, 4)
    per_pizza = rng.choice((8, 10, 12))
    need = guests * slices
    return (f"{n} is having a party for {guests} guests. Each guest will eat {slices} slices of pizza, and each "
            f"pizza has {per_pizza} slices. How many pizzas does {s} need to order?", -(-need // per_pizza))


def tickets(rng: random.Random) -> tuple[str, int]:
    price, goal, sold = rng.choice((5, 8, 10, 12, 15)), rng.randint(40, 120), rng.randint(5, 30)
    goal_money = goal * price
    sold = min(sold, goal - 1)
    group = rng.choice(("The school band", "A soccer team", "The drama club", "A charity"))
    return (f"{group} sells tickets for ${price} each and wants to raise ${goal_money}. They have sold {sold} "
            f"tickets so far. How many more tickets do they need to sell?", goal - sold)


def fuel(rng: random.Random) -> tuple[str, int]:
    n, _, p = _people(rng, 1)[0]
    mpg, gallons_price, trips = rng.choice((20, 25, 30, 40)), rng.choice((3, 4, 5)), rng.randint(2, 10)
    dist = mpg * rng.randint(1, 4)
    return (f"{n}'s car goes {mpg} miles on a gallon of gas, and gas costs ${gallons_price} a gallon. {n} makes "
            f"{trips} trips of {dist} miles each to visit {p} grandmother. How much does the gas cost?",
            trips * dist // mpg * gallons_price)


def budget(rng: random.Random) -> tuple[str, int]:
    n, s, p = _people(rng, 1)[0]
    salary = rng.choice((2400, 3000, 3600, 4800, 6000))
    rent_frac, food = rng.choice((3, 4)), rng.randint(2, 8) * 50
    return (f"{n} earns ${salary} a month. {s.capitalize()} spends 1/{rent_frac} of it on rent and ${food} on food. "
            f"How much of {p} salary is left?", salary - salary // rent_frac - food)


def comparison(rng: random.Random) -> tuple[str, int]:
    (a, _, _), (b, _, _), (c, _, _) = _people(rng, 3)
    item = rng.choice(COLLECTIBLES)
    base, times = rng.randint(4, 20), rng.randint(2, 4)
    fewer = rng.randint(2, min(9, times * base - 1))  # the third person keeps at least one
    word = {2: "twice", 3: "three times", 4: "four times"}[times]
    return (f"{a} has {word} as many {item} as {b}. {c} has {fewer} fewer {item} than {a}. If {b} has {base} {item}, "
            f"how many {item} do the three of them have altogether?", base + times * base + times * base - fewer)


def schedule(rng: random.Random) -> tuple[str, int]:
    n, s, _ = _people(rng, 1)[0]
    tasks = rng.sample(("laundry", "homework", "cleaning the kitchen", "walking the dog", "cooking dinner",
                        "practising piano"), 3)
    mins = [rng.choice((15, 20, 25, 30, 40, 45, 50)) for _ in tasks]
    (m1, t1), (m2, t2), (m3, t3) = zip(mins, tasks, strict=True)
    parts = f"{m1} minutes on {t1}, {m2} minutes on {t2} and {m3} minutes on {t3}"
    return (f"Every day {n} spends {parts}. How many minutes does {s} spend on these tasks in a week?",
            sum(mins) * 7)


def farm_legs(rng: random.Random) -> tuple[str, int]:
    n, _, _ = _people(rng, 1)[0]
    (a1, l1), (a2, l2) = rng.sample(ANIMALS, 2)
    x, y = rng.randint(2, 30), rng.randint(2, 30)
    return (f"On {n}'s farm there are {x} {a1} and {y} {a2}. How many legs do the animals have in total?",
            x * l1 + y * l2)


def running(rng: random.Random) -> tuple[str, int]:
    n, s, _ = _people(rng, 1)[0]
    first, days = rng.randint(2, 6), rng.randint(3, 5)
    d = DAYS[:days]
    return (f"{n} runs {first} miles on {d[0]}. Each day after that, up to {d[-1]}, {s} runs 1 mile more than the "
            f"day before. How many miles does {s} run from {d[0]} to {d[-1]}?", sum(first + i for i in range(days)))


def phone_plan(rng: random.Random) -> tuple[str, int]:
    n, _, p = _people(rng, 1)[0]
    base, incl, extra = rng.choice((20, 25, 30, 35)), rng.choice((5, 10, 15)), rng.choice((2, 3, 5))
    used = incl + rng.randint(1, 8)
    return (f"{n}'s phone plan costs ${base} a month and includes {incl} GB of data. Each extra GB costs ${extra}. "
            f"This month {n} used {used} GB. How much is {p} bill?", base + (used - incl) * extra)


def bus(rng: random.Random) -> tuple[str, int]:
    start, off1, on1 = rng.randint(10, 40), rng.randint(2, 8), rng.randint(2, 12)
    off2, on2 = rng.randint(2, 8), rng.randint(2, 6)  # from 2: "1 people" reads badly
    return (f"A bus leaves the station with {start} passengers. At the first stop {off1} people get off and {on1} "
            f"get on. At the second stop {off2} get off and {on2} get on. How many passengers are on the bus now?",
            start - off1 + on1 - off2 + on2)


def paint(rng: random.Random) -> tuple[str, int]:
    n, s, _ = _people(rng, 1)[0]
    w, h, walls, cover = rng.randint(8, 20), rng.choice((8, 9, 10)), rng.randint(2, 4), rng.choice((50, 100, 150))
    area = w * h * walls
    return (f"{n} wants to paint {walls} walls that are each {w} feet wide and {h} feet tall. One can of paint "
            f"covers {cover} square feet. How many cans does {s} need to buy?", -(-area // cover))


def restaurant(rng: random.Random) -> tuple[str, int]:
    friends, each, tip = rng.randint(2, 6), rng.randint(8, 30), rng.choice((10, 20))
    bill = friends * each * 10
    return (f"{friends} friends eat dinner together and the bill is ${bill}. They add a {tip}% tip and split the "
            f"total equally. How much does each friend pay?", bill * (100 + tip) // 100 // friends)


def interest(rng: random.Random) -> tuple[str, int]:
    n, s, _ = _people(rng, 1)[0]
    principal, rate, years = rng.choice((500, 1000, 1500, 2000, 5000)), rng.choice((2, 4, 5, 10)), rng.randint(2, 6)
    return (f"{n} puts ${principal} in a savings account that pays {rate}% simple interest per year. How much money "
            f"will {s} have after {years} years?", principal + principal * rate * years // 100)


def leftover_money(rng: random.Random) -> tuple[str, int]:
    n, s, p = _people(rng, 1)[0]
    left, second = rng.randint(2, 30) * 3, rng.choice(("a book", "lunch", "a gift", "a scarf"))
    first = rng.choice(("a video game", "new shoes", "a concert ticket", "art supplies"))
    # She spends half on the first thing and a third of the rest on the second: left = start * 1/2 * 2/3.
    return (f"{n} spent half of {p} money on {first}, then a third of what was left on "
            f"{second}. {s.capitalize()} has ${left} left. How much money did {n} have at the start?", left * 3)


def average(rng: random.Random) -> tuple[str, int]:
    n, s, p = _people(rng, 1)[0]
    k, mean = rng.randint(3, 5), rng.randint(70, 92)
    while True:  # a score the test allows
        scores = [mean + rng.randint(-8, 8) for _ in range(k - 1)]
        last = mean * k - sum(scores)
        if last <= 100:
            break
    listed = f"{', '.join(map(str, scores[:-1]))} and {scores[-1]}"
    return (f"{n}'s scores on {p} first {k - 1} tests were {listed}. What score does {s} need on the next test to "
            f"average exactly {mean}?", last)


def weekly_total(rng: random.Random) -> tuple[str, int]:
    n, s, _ = _people(rng, 1)[0]
    per_day, weekend = rng.randint(2, 9), rng.randint(1, 3)
    verb, base, thing = rng.choice((("drinks", "drink", "glasses of water"), ("writes", "write", "pages of notes"),
                                    ("answers", "answer", "emails"), ("does", "do", "sets of push-ups"),
                                    ("drinks", "drink", "cups of tea")))
    return (f"{n} {verb} {per_day} {thing} every weekday and {per_day * weekend} every day of the weekend. How many "
            f"{thing} does {s} {base} in 4 weeks?", 4 * (5 * per_day + 2 * per_day * weekend))


TEMPLATES: tuple[Callable[[random.Random], tuple[str, int]], ...] = (
    shopping, baking, savings, trip, ages, discount, garden, reading, fruit_stand, classroom, collection, pool,
    recipe, party, tickets, fuel, budget, comparison, schedule, farm_legs, running, phone_plan, bus, paint,
    restaurant, interest, leftover_money, average, weekly_total,
)
# Most evaluation prompts are the bare question; a few users add a request about the form.
SUFFIXES = ("", "", "", "", "", "", " Explain step by step.", " Show your work.", " Think it through before answering.")


def math_problem(index: int, seed: int = 0) -> tuple[str, str, int]:
    """(template name, problem text, its whole-number answer) of prompt `index`."""
    rng = random.Random(f"math:{seed}:{index}")
    make = TEMPLATES[index % len(TEMPLATES)]
    text, value = make(rng)
    return make.__name__, text + rng.choice(SUFFIXES), value


def iter_math_prompts(count: int = 6000, seed: int = 0) -> Iterator[Prompt]:
    for k in range(count):
        name, text, _ = math_problem(k, seed)
        yield Prompt(f"math:{name}:{k}", text)
