"""Hand-checked values for memupdate.metrics (LoCoMo, Mem0, SQuAD protocols and \\boxed extraction)."""

from __future__ import annotations

import doctest
import math
import warnings

import nltk
import pytest

from memupdate import metrics
from memupdate.metrics import (
    bleu1,
    exact_match,
    extract_boxed,
    locomo_f1,
    locomo_token_f1,
    mem0_f1,
    normalize_locomo_answer,
    normalize_squad,
    squad_f1,
    sub_exact_match,
)


def test_docstring_examples_pass():
    result = doctest.testmod(metrics)
    assert result.failed == 0
    assert result.attempted >= len(metrics.__all__)


# --- LoCoMo -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The cat, and a Dog!", "cat dog"),
        ("Andrew and Sandy", "andrew sandy"),  # only whole words: "and" inside names stays
        ("  Mr. Smith's   band ", "mr smiths band"),
        ("7 May, 2023", "7 may 2023"),
        ("", ""),
    ],
)
def test_normalize_locomo_answer(raw, expected):
    assert normalize_locomo_answer(raw) == expected


def test_locomo_token_f1_protocol_examples():
    # "painting running" -> stems [paint, run]; "running painting" -> [run, paint]: same multiset.
    assert locomo_token_f1("painting and running", "running, painting") == 1.0
    # pred [she, went, on, may, 7, 2023] vs gold [7, may, 2023]: P = 3/6, R = 3/3, F1 = 2/3.
    assert locomo_token_f1("She went on May 7, 2023", "7 May 2023") == pytest.approx(2 / 3)


def test_locomo_token_f1_stems_and_counts_multisets():
    assert locomo_token_f1("runs", "running") == 1.0  # both stem to "run"
    # pred [cat, cat, dog] vs gold [cat, dog]: overlap 2, P = 2/3, R = 1, F1 = 0.8.
    assert locomo_token_f1("cat cat dog", "cat dog") == pytest.approx(0.8)
    assert locomo_token_f1("Paris", "London") == 0.0


def test_locomo_category_1_splits_both_sides_on_commas():
    # Gold parts "running" and "painting"; the only prediction part is "painting and running"
    # -> [paint, run]. Each gold part: P = 1/2, R = 1, F1 = 2/3; mean = 2/3.
    assert locomo_f1("painting and running", "running, painting", 1) == pytest.approx(2 / 3)
    assert round(locomo_f1("painting and running", "running, painting", 1), 2) == 0.67
    # Gold parts hiking (1.0), swimming (1.0), reading (0.0): mean 2/3.
    assert locomo_f1("swimming, hiking", "hiking, swimming, reading", 1) == pytest.approx(2 / 3)
    assert locomo_f1("reading, hiking, swimming", "hiking, swimming", 1) == 1.0


@pytest.mark.parametrize("category", [2, 4])
def test_locomo_categories_2_and_4_are_plain_f1(category):
    assert locomo_f1("She went on May 7, 2023", "7 May 2023", category) == pytest.approx(2 / 3)
    assert locomo_f1("painting and running", "running, painting", category) == 1.0


def test_locomo_category_3_uses_first_semicolon_part():
    answer = "2022; the year after the pandemic"
    assert locomo_f1("2022", answer, 3) == 1.0
    # Without the rule: gold [2022, year, after, pandemic], P = 1, R = 1/4, F1 = 0.4.
    assert locomo_f1("2022", answer, 2) == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("Not mentioned in the conversation.", 1.0),
        ("NO INFORMATION AVAILABLE", 1.0),
        ("There is no information available about that.", 1.0),
        ("Paris", 0.0),
        ("no information", 0.0),
        ("", 0.0),
    ],
)
def test_locomo_category_5_rewards_abstention_and_ignores_answer(prediction, expected):
    assert locomo_f1(prediction, "Paris", 5) == expected
    assert locomo_f1(prediction, "", 5) == expected


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("a", 1.0),
        (" B\n", 0.0),
        ("(a)", 1.0),
        ("(b)", 0.0),
        ("x", 0.0),  # LoCoMo's rule: one character without an "a" is (b)
        ("(b) Not mentioned in the conversation", 1.0),  # a longer reply is scored as written
        ("b) Caroline", 0.0),
    ],
)
def test_locomo_choice_answer_maps_a_bare_letter_to_its_option(prediction, expected):
    options = {"a": "Not mentioned in the conversation", "b": "Caroline"}
    assert locomo_f1(metrics.locomo_choice_answer(prediction, options), "", 5) == expected


@pytest.mark.parametrize("category", [0, 6, -1])
def test_locomo_invalid_category_raises(category):
    with pytest.raises(ValueError, match=str(category)):
        locomo_f1("x", "x", category)


def test_locomo_int_like_and_empty_answers():
    assert locomo_f1("2022", "2022", 2) == 1.0
    assert locomo_f1("In 2022.", "2022", 2) == pytest.approx(2 / 3)  # P = 1/2, R = 1
    assert locomo_f1("2022", "2022", 1) == 1.0
    assert locomo_token_f1("", "2022") == 0.0
    assert locomo_token_f1("2022", "") == 0.0
    assert locomo_token_f1("", "") == 0.0
    assert locomo_f1("", "", 1) == 0.0
    assert locomo_f1("the", "a", 2) == 0.0  # both normalise to nothing


# --- Mem0 ---------------------------------------------------------------------------------------


def test_mem0_f1_protocol_examples():
    # {painting, and, running} vs {running, painting}: P = 2/3, R = 1, F1 = 0.8.
    assert mem0_f1("painting and running", "running, painting") == pytest.approx(0.8)
    # {she, went, on, may, 7, 2023} vs {7, may, 2023}: P = 3/6, R = 1, F1 = 2/3.
    assert mem0_f1("She went on May 7, 2023", "7 May 2023") == pytest.approx(2 / 3)


def test_mem0_f1_sets_no_stemming_limited_punctuation():
    assert mem0_f1("cat cat dog", "cat dog") == 1.0  # sets, unlike squad_f1 (0.8)
    assert mem0_f1("runs", "running") == 0.0  # no stemming
    assert mem0_f1("Paris!", "paris") == 1.0
    assert mem0_f1("Paris;", "paris") == 0.0  # only . , ! ? are stripped
    assert mem0_f1("the cat", "cat") == pytest.approx(2 / 3)  # no stop words: P = 1/2, R = 1


def test_mem0_f1_int_like_and_empty():
    assert mem0_f1("2022", "2022") == 1.0
    assert mem0_f1("", "2022") == 0.0
    assert mem0_f1("2022", "") == 0.0
    assert mem0_f1("...", "?!") == 0.0


# --- BLEU-1 -------------------------------------------------------------------------------------


def test_bleu1_hand_checked():
    # [the, cat, sat] vs [the, cat]: unigram precision 2/3; hyp longer than ref, so no brevity penalty.
    assert bleu1("The cat sat", "the cat") == pytest.approx(2 / 3)
    # [7, may, 2023] vs [she, went, on, may, 7, ",", 2023]: precision 1, BP = exp(1 - 7/3).
    assert bleu1("7 May 2023", "She went on May 7, 2023") == pytest.approx(math.exp(-4 / 3))
    # [she, went, on, may, 7, ",", 2023] vs [7, may, 2023]: precision 3/7, BP = 1.
    assert bleu1("She went on May 7, 2023", "7 May 2023") == pytest.approx(3 / 7)
    # Treebank tokens: [do, n't] vs [do, not]: precision 1/2.
    assert bleu1("Don't", "do not") == pytest.approx(0.5)
    assert bleu1("2022", "2022") == 1.0


def test_bleu1_zero_overlap_and_empty_are_silent_floats():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for prediction, answer in [("Paris", "London"), ("", "London"), ("   ", "x"), ("x", "")]:
            score = bleu1(prediction, answer)
            assert score == 0.0
            assert type(score) is float


def test_bleu1_needs_no_nltk_data(monkeypatch):
    def no_data(*args, **kwargs):
        raise LookupError("no NLTK data in this test")

    monkeypatch.setattr(nltk.data, "find", no_data)
    monkeypatch.setattr(nltk.data, "load", no_data)
    assert bleu1("The cat sat.", "the cat") == pytest.approx(2 / 4)  # [the, cat, sat, .]


# --- SQuAD --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The  Eiffel-Tower!", "eiffeltower"),
        ("An apple and a pear", "apple and pear"),  # "and" is not an article here
        ("Theatre", "theatre"),
        ("", ""),
    ],
)
def test_normalize_squad(raw, expected):
    assert normalize_squad(raw) == expected


def test_exact_match():
    assert exact_match("The Beatles.", "beatles") == 1.0
    assert exact_match("Beatles", "The Rolling Stones") == 0.0
    assert exact_match("2022", "2022") == 1.0
    assert exact_match("the", "") == 1.0  # SQuAD: both normalise to "", which is equal
    assert exact_match("Queen", ["beatles", "queen"]) == 1.0
    assert exact_match("Queen", ("beatles", "abba")) == 0.0


def test_sub_exact_match():
    assert sub_exact_match("It was in Paris, France.", "paris") == 1.0  # prediction contains gold
    assert sub_exact_match("Paris", "Paris, France") == 1.0  # gold contains prediction
    assert sub_exact_match("in 2022", "2022") == 1.0
    assert sub_exact_match("London", "Paris") == 0.0
    assert sub_exact_match("", "paris") == 0.0
    assert sub_exact_match("paris", "") == 0.0
    assert sub_exact_match("the", "a") == 0.0  # both empty after normalisation: never a match
    assert sub_exact_match("London", ["Paris", "london bridge"]) == 1.0


def test_squad_f1():
    # [cat, sat] vs [cat]: P = 1/2, R = 1, F1 = 2/3.
    assert squad_f1("the cat sat", "a cat") == pytest.approx(2 / 3)
    # Multiset: [cat, cat, dog] vs [cat, dog]: overlap 2, P = 2/3, R = 1, F1 = 0.8.
    assert squad_f1("cat cat dog", "cat dog") == pytest.approx(0.8)
    assert squad_f1("runs", "running") == 0.0  # no stemming
    assert squad_f1("2022", "2022") == 1.0
    assert squad_f1("", "2022") == 0.0
    assert squad_f1("", "") == 0.0
    assert squad_f1("the cat sat", ["dog", "cat sat", "cat"]) == 1.0


@pytest.mark.parametrize("metric", [exact_match, sub_exact_match, squad_f1])
def test_squad_metrics_reject_empty_gold_list(metric):
    with pytest.raises(ValueError, match="no gold"):
        metric("x", [])


# --- \boxed{} -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"The answer is \boxed{5}.", "5"),
        (r"$\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{\frac{a}{b^{2}}}}", r"\sqrt{\frac{a}{b^{2}}}"),
        (r"first \boxed{1}, then \boxed{2}", "2"),
        (r"\boxed{1} and finally \fbox{x+y}", "x+y"),
        (r"\fbox{7}", "7"),
        (r"so $\boxed 42$", "42"),
        (r"\boxed 5", "5"),
        (r"\boxed {3}", "3"),
        (r"\boxed{}", ""),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        ("\\boxed{2022}", "2022"),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "no box here",
        "",
        r"\boxed{1} and then \boxed{2",  # the last box is unclosed: no fallback to the first
        r"\boxed{\frac{1}{2}",
        r"ends with \boxed",
        r"\boxed5",  # not `\boxed ` + token
        r"\boxedtext{5}",  # a different command
    ],
)
def test_extract_boxed_none(text):
    assert extract_boxed(text) is None
