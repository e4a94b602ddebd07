"""Tests for attnmask.data.synthetic: the synthetic dates task and the task registry."""

from __future__ import annotations

import contextlib
import datetime
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnmask.data.synthetic import (
    DATE_TEMPLATES,
    EVERYDAY_DATES,
    SPLITS,
    TWO_DIGIT_YEAR_WINDOW,
    format_date,
    get_task,
    make_date_pairs,
    ordinal_suffix,
    ordinal_words,
    split_of,
    task_registry,
)

WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]


@pytest.fixture(scope="module")
def train_pairs() -> list[tuple[str, str]]:
    return make_date_pairs(3000, seed=0, split="train")


def test_examples_from_the_spec():
    day = datetime.date(2026, 11, 22)
    assert format_date(day, "{D} {Month} {Y4}") == "22 November 2026"
    assert format_date(day, "{Mon} {D}, {Y4}") == "Nov 22, 2026"
    assert format_date(day, "{MM}/{DD}/{Y4}") == "11/22/2026"
    assert format_date(day, "{Wkday}, the {Dth} of {Month} {Y4}") == "Sunday, the 22nd of November 2026"
    assert format_date(day, "{DD}.{MM}.{Y2}") == "22.11.26"
    assert format_date(day, "{Month} {Dwords}, {Y4}", "lower") == "november twenty-second, 2026"
    assert format_date(day, "{Wk} {Mon} {D} {Y4}", "upper") == "SUN NOV 22 2026"
    assert format_date(datetime.date(2026, 5, 3), "{MonDot} {D}, {Y4}") == "May 3, 2026"


def test_ordinals_literal():
    assert [ordinal_suffix(d) for d in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 31)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "31st",
    ]  # fmt: skip
    assert [ordinal_words(d) for d in (1, 12, 20, 21, 30, 31)] == [
        "first", "twelfth", "twentieth", "twenty-first", "thirtieth", "thirty-first",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="day=40"):
        ordinal_words(40)


def test_targets_are_iso_dates_in_range(train_pairs):
    for source, target in train_pairs:
        date = datetime.date.fromisoformat(target)
        assert date.isoformat() == target
        assert 1900 <= date.year <= 2099, source


def test_year_range_arguments():
    for _, target in make_date_pairs(200, seed=1, min_year=2000, max_year=2001):
        assert datetime.date.fromisoformat(target).year in (2000, 2001)


def test_weekdays_are_correct(train_pairs):
    checked = 0
    for source, target in train_pairs:
        words = set(re.findall(r"[a-z]+", source.lower()))
        named = [i for i, name in enumerate(WEEKDAYS) if name in words or name[:3] in words]
        if named:
            assert named == [datetime.date.fromisoformat(target).weekday()], (source, target)
            checked += 1
    assert checked > 300, "the task should write weekdays often enough to test them"


# Independent parsers for some formats (strptime is case-insensitive for names).
STRPTIME_FORMATS = [
    "%d %B %Y", "%B %d, %Y", "%b %d, %Y", "%d/%m/%Y", "%d.%m.%Y", "%d-%m-%Y", "%Y-%m-%d", "%Y/%m/%d",
    "%Y%m%d", "%d-%b-%Y", "%A, %B %d, %Y", "%a, %d %b %Y", "%a %b %d %Y", "%A %d %B %Y", "%d %b %Y",
]  # fmt: skip


def test_sources_parse_back_to_their_target(train_pairs):
    parsed = 0
    for source, target in train_pairs:
        for fmt in STRPTIME_FORMATS:
            try:
                date = datetime.datetime.strptime(source, fmt).date()
            except ValueError:
                continue
            assert date.isoformat() == target, (source, fmt)
            parsed += 1
            break
    assert parsed > len(train_pairs) // 3


def test_two_digit_years_only_inside_window(train_pairs):
    # Ends in a two-digit year: 11/22/26, 22.11.26, Nov 22 '26, 22-Nov-26 (not year-first ISO forms).
    two_digit = re.compile(r"^(?!\d{4})(.*[/.']\d{2}|.*[A-Za-z]-\d{2})$")
    low, high = TWO_DIGIT_YEAR_WINDOW
    found = 0
    for source, target in train_pairs:
        if two_digit.search(source):
            year = datetime.date.fromisoformat(target).year
            assert low <= year <= high, (source, target)
            assert source[-2:] == target[2:4], (source, target)
            found += 1
    assert found > 50
    with pytest.raises(ValueError, match="cannot write 1920-01-05 with a two-digit year"):
        format_date(datetime.date(1920, 1, 5), "{DD}.{MM}.{Y2}")


def test_formats_are_varied(train_pairs):
    sources = [s for s, _ in train_pairs]
    assert any(s.islower() and re.search("[a-z]", s) for s in sources)
    assert any(s.isupper() for s in sources)
    assert any("twenty-" in s.lower() for s in sources)
    assert any(re.fullmatch(r"\d{1,2}/\d{1,2}/\d{4}", s) for s in sources)
    assert any(re.fullmatch(r"\d{2}\.\d{2}\.\d{2}", s) for s in sources)
    # Every template is used (3000 draws over ~30 templates).
    shapes = {re.sub(r"[A-Za-z]+", "w", re.sub(r"\d+", "9", s)) for s in sources}
    assert len(shapes) >= 20


def test_deterministic():
    assert make_date_pairs(50, seed=3, split="valid") == make_date_pairs(50, seed=3, split="valid")
    assert make_date_pairs(50, seed=3) != make_date_pairs(50, seed=4)
    assert make_date_pairs(0, seed=3) == []


def test_splits_are_disjoint():
    by_split = {split: make_date_pairs(1500, seed=0, split=split) for split in SPLITS}
    folded = {split: {s.casefold() for s, _ in pairs} for split, pairs in by_split.items()}
    assert not folded["train"] & folded["valid"]
    assert not folded["train"] & folded["test"]
    assert not folded["valid"] & folded["test"]
    for split, pairs in by_split.items():
        assert all(split_of(source) == split for source, _ in pairs)
    # Disjoint for any seeds, not just equal ones.
    other = {s.casefold() for s, _ in make_date_pairs(1500, seed=99, split="test")}
    assert not folded["train"] & other


@settings(max_examples=100, deadline=None)
@given(
    date=st.dates(min_value=datetime.date(1950, 1, 1), max_value=datetime.date(2049, 12, 31)),
    template=st.sampled_from(DATE_TEMPLATES),
    case=st.sampled_from(["as is", "lower", "upper"]),
)
def test_split_ignores_letter_case(date, template, case):
    source = format_date(date, template, case)
    assert split_of(source) == split_of(format_date(date, template))


def test_argument_errors():
    with pytest.raises(ValueError, match=r"split='dev'; expected one of \('train', 'valid', 'test'\)"):
        make_date_pairs(5, seed=0, split="dev")
    with pytest.raises(ValueError, match="n=-1"):
        make_date_pairs(-1, seed=0)
    with pytest.raises(ValueError, match="min_year=2000, max_year=1999"):
        make_date_pairs(5, seed=0, min_year=2000, max_year=1999)
    with pytest.raises(ValueError, match="case='title'"):
        format_date(datetime.date(2000, 1, 1), "{D}", "title")


def test_registry():
    task = task_registry["dates"]
    assert get_task("dates") is task
    pairs = task.make_pairs(5, seed=1, split="test")
    assert pairs == make_date_pairs(5, seed=1, split="test")
    assert task.tokenizer in ("chars", "bpe")
    source, target = task.example
    assert target == "2026-11-22" and "November" in source
    with pytest.raises(ValueError, match=r"unknown task 'nope'; expected one of \['dates'\]"):
        get_task("nope")


# ---------------------------------------------------------------------------------------------
# Numbers-only dates are day first; the forms people type are covered and held out
# ---------------------------------------------------------------------------------------------
def test_numeric_dates_are_day_first():
    day = datetime.date(2000, 2, 1)  # 1 February 2000
    numeric = {format_date(day, t) for t in DATE_TEMPLATES} & {
        s for s in (format_date(day, t) for t in DATE_TEMPLATES) if re.fullmatch(r"[\d/.\-']+", s)
    }
    assert {"1/2/2000", "01/02/2000", "1.2.2000", "1-2-2000", "2000-02-01", "2000-2-1", "20000201"} <= numeric
    assert "2/1/2000" not in numeric and "02/01/2000" not in numeric  # never month first


def test_no_source_means_two_dates():
    """Over all templates and 2,000 dates, a source string always maps to one date."""
    seen: dict[str, str] = {}
    rng = __import__("random").Random(0)
    first, last = datetime.date(1950, 1, 1).toordinal(), datetime.date(2049, 12, 31).toordinal()
    for _ in range(2000):
        date = datetime.date.fromordinal(rng.randint(first, last))
        for template in DATE_TEMPLATES:
            source = format_date(date, template).casefold()
            assert seen.setdefault(source, date.isoformat()) == date.isoformat(), source


def test_single_digit_days_are_well_represented(train_pairs):
    single = sum(datetime.date.fromisoformat(t).day <= 9 for _, t in train_pairs) / len(train_pairs)
    assert 0.42 < single < 0.58, single  # 1/3 forced + 2/3 x 9/31 from the calendar: ~0.53


def test_everyday_forms_are_producible_and_never_trained_on():
    producible = set()
    for date_iso in {iso for _, iso in EVERYDAY_DATES}:
        date = datetime.date.fromisoformat(date_iso)
        for template in DATE_TEMPLATES:
            for case in ("as is", "lower", "upper"):
                with contextlib.suppress(ValueError):  # a two-digit year outside the window
                    producible.add((format_date(date, template, case), date_iso))
    assert len(EVERYDAY_DATES) == 50 and len({s for s, _ in EVERYDAY_DATES}) == 50
    assert set(EVERYDAY_DATES) <= producible, set(EVERYDAY_DATES) - producible
    # drawn from a few years, so that they would come up in training, they still never do
    everyday = {s.casefold() for s, _ in EVERYDAY_DATES}
    train = make_date_pairs(20000, seed=0, split="train", min_year=1999, max_year=2002)
    assert not everyday & {s.casefold() for s, _ in train}
    # the other splits may hold them: held out of training is what matters
    assert any(
        s.casefold() in everyday for s, _ in make_date_pairs(5000, seed=0, split="test", min_year=1999, max_year=2002)
    )
