"""Built-in synthetic translation tasks, generated on the fly (no downloads), for ``attnmask demo``.

A task turns ``(n, seed, split)`` into ``n`` ``(source, target)`` string pairs. Generation is
deterministic, and the ``train``/``valid``/``test`` splits never share a source: each candidate
source is assigned to a split by a hash of its text, so a split is a fixed subset of all the
sources the task can produce.

The ``dates`` task: a calendar date written in one of many human formats (month and weekday
names, abbreviations, ordinals in digits or words, numbers with slashes, dots or dashes, with or
without leading zeros, two-digit years, lower/upper case) → the ISO 8601 date, e.g.
``"Sunday, the 22nd of November 2026"`` → ``"2026-11-22"``.

Numeric dates are read **day first** (:data:`NUMERIC_ORDER`), as in most of the world:
``1/2/2000`` is 1 February 2000, whatever the separator (``1/2/2000``, ``1.2.2000``,
``1-2-2000``); a four-digit year written first means year-month-day (``2000-02-01``,
``2000/2/1``). Month-first numbers (the US ``M/D/Y``) are never generated, so every source has
exactly one correct target. Days 1-9 are drawn more often than the calendar would (a third of the
examples), since single-digit days are what people type most and what a model confuses most
(``1 Feb 2000`` read as the 11th). :data:`EVERYDAY_DATES` lists 50 forms people type; they are
never part of the training split.
"""

from __future__ import annotations

import datetime
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from attnmask.errors import UserError

SPLITS = ("train", "valid", "test")
# Percent of the hash space per split: 80 / 10 / 10.
_SPLIT_BUCKETS = {"train": range(0, 80), "valid": range(80, 90), "test": range(90, 100)}

# Two-digit years are read with a pivot (like strptime's %y, which pivots at 69): 50-99 → 1950-1999,
# 00-49 → 2000-2049. Dates outside that window are never written with two digits, so every
# source has exactly one correct target.
TWO_DIGIT_YEAR_WINDOW = (1950, 2049)

_MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_ORDINAL_WORDS = (
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
    "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth",
    "seventeenth", "eighteenth", "nineteenth", "twentieth",
)  # fmt: skip

NUMERIC_ORDER = "day-month-year"  # how numbers-only dates are read: 1/2/2000 = 1 February 2000

# Field names usable in templates: {Y4} 2026, {Y2} 26, {M} 11, {MM} 11, {Month} November,
# {Mon} Nov, {MonDot} Nov. (May stays May), {D} 2, {DD} 02, {Dth} 2nd, {Dwords} second,
# {Wkday} Sunday, {Wk} Sun.
# Numbers-only dates are day first (D/M/Y, D.M.Y, D-M-Y) or, with the four-digit year first,
# year-month-day; so no source string can be read as two different dates.
DATE_TEMPLATES = (
    "{D} {Month} {Y4}",
    "{DD} {Month} {Y4}",
    "{D} {Month}, {Y4}",
    "{D} {Mon} {Y4}",
    "{D} {MonDot} {Y4}",
    "{Dth} {Month} {Y4}",
    "{Dth} {Mon} {Y4}",
    "{Dth} of {Month} {Y4}",
    "the {Dth} of {Month}, {Y4}",
    "{Month} {D}, {Y4}",
    "{Month} {D} {Y4}",
    "{Month} {Dth}, {Y4}",
    "{Mon} {D}, {Y4}",
    "{Mon} {D} {Y4}",
    "{MonDot} {D}, {Y4}",
    "{Mon} {D} '{Y2}",
    "{Month} {Dwords}, {Y4}",
    "the {Dwords} of {Month} {Y4}",
    "{Wkday}, the {Dth} of {Month} {Y4}",
    "{Wkday}, the {Dwords} of {Month}, {Y4}",
    "{Wkday}, {Month} {D}, {Y4}",
    "{Wkday} {D} {Month} {Y4}",
    "{Wkday}, {D} {Month} {Y4}",
    "{Wk}, {D} {Mon} {Y4}",
    "{Wk} {Mon} {D} {Y4}",
    "{Wk}, {DD}/{MM}/{Y2}",
    "{DD}/{MM}/{Y4}",
    "{D}/{M}/{Y4}",
    "{D}/{M}/{Y2}",
    "{DD}/{MM}/{Y2}",
    "{DD}.{MM}.{Y4}",
    "{D}.{M}.{Y4}",
    "{DD}.{MM}.{Y2}",
    "{D}-{M}-{Y4}",
    "{DD}-{MM}-{Y4}",
    "{D}-{Mon}-{Y4}",
    "{DD}-{Mon}-{Y2}",
    "{Y4}-{MM}-{DD}",
    "{Y4}-{M}-{D}",
    "{Y4}/{MM}/{DD}",
    "{Y4}/{M}/{D}",
    "{Y4}{MM}{DD}",
)
SINGLE_DIGIT_DAY_SHARE = 1 / 3  # share of examples whose day is 1-9 (the calendar gives 9/31)

# Forms people type, with the date each means (day first where numbers only). Held out of the
# training split; the demo reports how many its model gets right and prints a handful.
EVERYDAY_DATES = (
    ("1 Feb 2000", "2000-02-01"), ("2 Feb 2002", "2002-02-02"), ("1 Jan 2000", "2000-01-01"),
    ("1/2/2000", "2000-02-01"), ("3/4/2021", "2021-04-03"), ("12/11/2019", "2019-11-12"),
    ("25/12/2020", "2020-12-25"), ("01/02/2003", "2003-02-01"), ("1.2.2000", "2000-02-01"),
    ("7.7.2007", "2007-07-07"), ("1-1-2001", "2001-01-01"), ("2000-01-01", "2000-01-01"),
    ("2024-2-29", "2024-02-29"), ("2 February 2002", "2002-02-02"), ("February 2, 2002", "2002-02-02"),
    ("Feb 2, 2002", "2002-02-02"), ("Feb 2 2002", "2002-02-02"), ("feb 2 2002", "2002-02-02"),
    ("1st January 2000", "2000-01-01"), ("the 1st of May, 2021", "2021-05-01"), ("May 1, 2021", "2021-05-01"),
    ("9 Sep 1999", "1999-09-09"), ("31 Dec 1999", "1999-12-31"), ("1 January 2001", "2001-01-01"),
    ("4 July 1976", "1976-07-04"), ("July 4, 1976", "1976-07-04"), ("11 Nov 1918", "1918-11-11"),
    ("5/11/1955", "1955-11-05"), ("23 Oct 2023", "2023-10-23"), ("10 Oct 2010", "2010-10-10"),
    ("20200101", "2020-01-01"), ("Monday, 1 January 2024", "2024-01-01"), ("Mon, 1 Jan 2024", "2024-01-01"),
    ("3-Mar-2003", "2003-03-03"), ("1/2/00", "2000-02-01"), ("Jan 1 '99", "1999-01-01"),
    ("6 jun 2006", "2006-06-06"), ("DEC 25, 2025", "2025-12-25"), ("8 August 2008", "2008-08-08"),
    ("29 Feb 2024", "2024-02-29"), ("12th March 2012", "2012-03-12"), ("March 3rd, 2003", "2003-03-03"),
    ("the twenty-second of November 2026", "2026-11-22"), ("22 Nov 2026", "2026-11-22"),
    ("22/11/2026", "2026-11-22"), ("Nov 22, 2026", "2026-11-22"), ("5 May 2005", "2005-05-05"),
    ("2 Jan 1900", "1900-01-02"), ("31/12/2099", "2099-12-31"), ("1 Sep. 2001", "2001-09-01"),
)  # fmt: skip
_HELD_OUT = frozenset(source.casefold() for source, _ in EVERYDAY_DATES)
_CASES = (("as is", 0.6), ("lower", 0.25), ("upper", 0.15))


def ordinal_suffix(day: int) -> str:
    """``1`` → ``"1st"``, ``2`` → ``"2nd"``, ``11`` → ``"11th"``, ``22`` → ``"22nd"``."""
    if 11 <= day % 100 <= 13:
        return f"{day}th"
    return f"{day}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(day % 10, 'th') }"


def ordinal_words(day: int) -> str:
    """``22`` → ``"twenty-second"``, for ``1 <= day <= 39``."""
    if not 1 <= day <= 39:
        raise UserError(f"day={day}; expected 1 <= day <= 39")
    if day <= 20:
        return _ORDINAL_WORDS[day - 1]
    tens, ones = divmod(day, 10)
    tens_word = {2: "twenty", 3: "thirty"}[tens]
    return f"{tens_word}-{_ORDINAL_WORDS[ones - 1]}" if ones else f"{tens_word[:-1]}ieth"


def date_fields(date: datetime.date) -> dict[str, str]:
    """Every template field of :data:`DATE_TEMPLATES` for ``date`` (``{Y2}`` regardless of window)."""
    month = _MONTHS[date.month - 1]
    weekday = _WEEKDAYS[date.weekday()]
    return {
        "Y4": f"{date.year:04d}",
        "Y2": f"{date.year % 100:02d}",
        "M": str(date.month),
        "MM": f"{date.month:02d}",
        "Month": month,
        "Mon": month[:3],
        "MonDot": month if len(month) <= 3 else f"{month[:3]}.",
        "D": str(date.day),
        "DD": f"{date.day:02d}",
        "Dth": ordinal_suffix(date.day),
        "Dwords": ordinal_words(date.day),
        "Wkday": weekday,
        "Wk": weekday[:3],
    }


def format_date(date: datetime.date, template: str, case: str = "as is") -> str:
    """``date`` written with ``template`` (one of :data:`DATE_TEMPLATES`) in ``case``.

    Raises:
        ValueError: ``case`` is unknown, or the template writes a two-digit year for a date
            outside :data:`TWO_DIGIT_YEAR_WINDOW` (it would be ambiguous).
    """
    if "{Y2}" in template and not TWO_DIGIT_YEAR_WINDOW[0] <= date.year <= TWO_DIGIT_YEAR_WINDOW[1]:
        raise UserError(
            f"cannot write {date.isoformat()} with a two-digit year; expected a year in "
            f"{TWO_DIGIT_YEAR_WINDOW[0]}-{TWO_DIGIT_YEAR_WINDOW[1]}"
        )
    text = template.format(**date_fields(date))
    if case == "as is":
        return text
    if case == "lower":
        return text.lower()
    if case == "upper":
        return text.upper()
    raise UserError(f"case={case!r}; expected one of {[c for c, _ in _CASES]}")


def split_of(source: str) -> str:
    """The split a source string belongs to, from a hash of its case-folded text.

    Case-folding keeps ``"Nov 22, 2026"`` and ``"NOV 22, 2026"`` in the same split, so a split's
    sources differ from other splits' in more than letter case.
    """
    digest = hashlib.blake2b(source.casefold().encode("utf-8"), digest_size=8).digest()
    bucket = int.from_bytes(digest, "little") % 100
    return next(name for name, buckets in _SPLIT_BUCKETS.items() if bucket in buckets)


def make_date_pairs(
    n: int,
    *,
    seed: int = 0,
    split: str = "train",
    min_year: int = 1900,
    max_year: int = 2099,
) -> list[tuple[str, str]]:
    """``n`` pairs ``(date in a human format, ISO 8601 date)``, e.g. ``("Nov 22, 2026", "2026-11-22")``.

    Dates are uniform over ``min_year-01-01 .. max_year-12-31``, except that a share
    :data:`SINGLE_DIGIT_DAY_SHARE` get a day 1-9; a template and a letter case are drawn per
    example. Only sources that :func:`split_of` assigns to ``split`` are kept, so the splits are
    disjoint for any seeds, and :data:`EVERYDAY_DATES` never enter ``"train"``; within a split a
    pair may repeat (rarely). The same ``(n, seed, split, min_year, max_year)`` always gives the
    same list.

    Raises:
        ValueError: ``n`` is negative, ``split`` is unknown, or the year range is empty or
            outside 1..9999.
    """
    if n < 0:
        raise UserError(f"n={n}; expected a non-negative number of pairs")
    if split not in SPLITS:
        raise UserError(f"split={split!r}; expected one of {SPLITS}")
    if not 1 <= min_year <= max_year <= 9999:
        raise UserError(f"min_year={min_year}, max_year={max_year}; expected 1 <= min_year <= max_year <= 9999")
    # A string seed is hashed with SHA-512 by random.Random, so it is stable across processes.
    rng = random.Random(f"attnmask.data.synthetic.dates:{seed}:{split}")
    first = datetime.date(min_year, 1, 1).toordinal()
    last = datetime.date(max_year, 12, 31).toordinal()
    four_digit = [t for t in DATE_TEMPLATES if "{Y2}" not in t]
    cases, weights = zip(*_CASES)
    pairs: list[tuple[str, str]] = []
    while len(pairs) < n:
        date = datetime.date.fromordinal(rng.randint(first, last))
        if rng.random() < SINGLE_DIGIT_DAY_SHARE:
            date = date.replace(day=rng.randint(1, 9))
        in_window = TWO_DIGIT_YEAR_WINDOW[0] <= date.year <= TWO_DIGIT_YEAR_WINDOW[1]
        template = rng.choice(DATE_TEMPLATES if in_window else four_digit)
        case = rng.choices(cases, weights)[0]
        source = format_date(date, template, case)
        if split_of(source) == split and not (split == "train" and source.casefold() in _HELD_OUT):
            pairs.append((source, date.isoformat()))
    return pairs


@dataclass(frozen=True)
class Task:
    """A synthetic translation task.

    Attributes:
        name: registry key, used on the command line.
        description: one line for ``--help`` and logs.
        make_pairs: ``(n, *, seed, split) -> list[(source, target)]``, deterministic, with
            disjoint ``"train"``/``"valid"``/``"test"`` splits.
        tokenizer: the tokenizer kind that suits the task: ``"chars"`` or ``"bpe"``.
        example: one ``(source, target)`` pair to show users.
    """

    name: str
    description: str
    make_pairs: Callable[..., list[tuple[str, str]]]
    tokenizer: str
    example: tuple[str, str]


task_registry: dict[str, Task] = {
    "dates": Task(
        name="dates",
        description="dates written in many human formats -> ISO 8601 (YYYY-MM-DD)",
        make_pairs=make_date_pairs,
        tokenizer="chars",
        example=("Sunday, the 22nd of November 2026", "2026-11-22"),
    ),
}


def get_task(name: str) -> Task:
    """The registered task called ``name``. Raises ValueError listing the known names."""
    try:
        return task_registry[name]
    except KeyError:
        raise UserError(f"unknown task {name!r}; expected one of {sorted(task_registry)}") from None
